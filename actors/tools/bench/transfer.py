"""``ringfence bench transfer``: block copies between tiers, and the harness in fence vs sync mode.

Two measurements in one run:

1. Swap bandwidth. Batches of ``--batches`` (1, 4, 16, 64, 256, 1024) KV blocks of the
   ``small`` preset's layout (float32, block size 16: 256 KiB a block) are copied
   host -> device and device -> host between two CPU block-major tensors of
   ``max(batches)`` blocks each: the host one a named shared-memory segment of a fresh
   run id (``create_kv(layout, "cpu", shm_name=...)``, the segment the Transfer lanes
   map), the device one a plain tensor. Both are written once before anything is timed,
   so no first-touch page fault of the pools is measured. Methods, each over the same
   block ids:

   * ``plain``: one contiguous ``dst[b:b+n].copy_(src[a:a+n])`` of the same bytes (the
     ceiling), at a random offset per call like the others, so no method is timed on a
     cache-hot range;
   * ``copy_blocks``: :func:`ringfence.actors.kv.copies.copy_blocks` over random,
     scattered block ids on both sides (the runtime's swap path, the headline figure);
   * ``copy_blocks_consecutive``: the same over one consecutive run of ids (one ``copy_``);
   * ``copy_kernel``: ``copy_blocks(..., method="kernel")`` over the scattered ids: one
     Triton launch for the batch (``actors/kv/block_kernel.py``), on CUDA reading or
     writing the host tier in place through its mapping (the host tier registered as the
     swap lane registers it for the kernel, ``copies.HOST_MAPPED``). Timed by default on
     CUDA with Triton installed; on the CPU only with ``--kernel`` (Triton's interpreter
     runs it there: a test of the method, not a figure);
   * ``index_select_copy``: ``torch.index_select(src, 0, idx)`` into a fresh tensor, then
     ``dst.index_copy_(0, idx, tmp)``;
   * ``index_select_out``: ``torch.index_select(src, 0, idx, out=staging)`` into a
     preallocated (and pre-touched) staging tensor, then ``index_copy_`` from it.

   Index tensors are built inside the timed call (``copy_blocks`` takes the lists).
   Small batches repeat the call on fresh ids until ``REP_BLOCKS`` blocks were copied.
   GB/s is 1e9 bytes a second of block data moved. The ratio copy_blocks / plain is
   reported for scattered and consecutive ids; the target is at least 0.7x for batches
   of 64 blocks and more (scattered ids). Where the kernel is timed, so is copy_kernel /
   plain (``ratio_kernel``), its target 0.8x at 64 blocks and more (issue 47).

2. Harness throughput (transfer_harness.py). The protocol harness (``...testing.harness:TOPOLOGY``)
   is launched twice as a real run (``ringfence launch`` in a temporary folder:
   supervisor, Worker, swap and store lanes, each its own process), once with
   ``transfer.mode=fence`` and once with ``sync``, on the same programs
   (``--programs`` of ``--ops`` ops, no oracle check, no chaos delay, the local storage
   backend), and ``harness.json``'s ops per second (over the time programs ran, not
   the start-up) are reported with the ratio fence / sync. Fence mode lets swaps and
   store ops run while steps do; sync mode holds each op until what its fence names
   has completed, so it should be clearly slower where they overlap. The ``small``
   preset in float32 (device and host pools of 64 blocks) makes steps and swaps both
   take real time.

   Every launched process gets ``OMP_NUM_THREADS=--threads`` (default: the CPUs / 4,
   at least 1, since four actor processes share the machine): with torch's default
   (every process as many threads as CPUs) the Worker's steps went from ~30 ms to
   ~1 s on a 2-CPU machine, which measures oversubscription, not the protocol.
   Each launch runs under ``--timeout`` seconds; past it its process group is killed
   and its shared-memory names removed. A nonzero exit, a missing report or a program
   with failed ops is an error (exit status 1).

Part 1 is ``transfer_bandwidth.py`` (``--rounds``, 5, after one untimed warm-up round;
medians), part 2 ``transfer_harness.py``; this module holds the options and the report.
``--quick`` (the test) shrinks
everything: the ``tiny`` preset (8 KiB blocks), batches up to 64, 2 rounds, and a
harness of 3 programs of 20 ops on the ``tiny`` preset. torch is imported only when
the benchmark runs, so the ``ringfence`` command starts fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import orjson

from ringfence.actors.tools.bench.launcher import RunError
from ringfence.actors.tools.bench.options import add_counts, resolve_counts, resolve_preset
from ringfence.actors.tools.bench.transfer_bandwidth import (
    BATCHES,
    KERNEL,
    KERNEL_TARGET_RATIO,
    QUICK_BATCHES,
    QUICK_REP_BLOCKS,
    REP_BLOCKS,
    TARGET_MIN_BLOCKS,
    TARGET_RATIO,
    bench_bandwidth,
)
from ringfence.actors.tools.bench.transfer_harness import MODES, bench_harness

# name: (default, quick default, help)
COUNTS: dict[str, tuple[int, int, str]] = {
    "rounds": (5, 2, "timed bandwidth rounds (after one warm-up round)"),
    "programs": (20, 3, "harness programs per mode"),
    "ops": (40, 20, "ops per harness program"),
    "timeout": (600, 120, "seconds each launched harness run may take"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument("--quick", action="store_true", help="tiny blocks, small runs (tests)")
    parser.add_argument("--preset", help="model preset of the blocks and the harness (small)")
    add_counts(parser, COUNTS)
    parser.add_argument(
        "--threads",
        type=int,
        help="OMP_NUM_THREADS of every launched harness process (CPUs / 4, at least 1)",
    )
    parser.add_argument(
        "--skip-harness", action="store_true", help="only the bandwidth part (no launched runs)"
    )
    parser.add_argument(
        "--kernel",
        action="store_true",
        help="time the batched copy kernel on the CPU too, in Triton's interpreter (slow: "
        "a test of the method; on CUDA it is timed whenever Triton is installed)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="the device tier: cpu (a second CPU tensor) or cuda (the host tier pinned, "
        "copies queued as the swap lane queues them) (%(default)s)",
    )


# Report.


def _print(report: dict[str, Any]) -> None:
    bw = report["bandwidth"]
    print(
        f"torch {report['torch']}, {report['threads']} thread(s), {report['cpus']} CPU(s); "
        f"blocks of preset {bw['preset']} ({bw['block_bytes'] // 1024} KiB, {bw['dtype']}, "
        f"block size {bw['block_size']}), pools of {bw['pool_blocks']} blocks; device tier "
        f"on {bw['device']}"
    )
    print(f"swap bandwidth, GB/s, median of {bw['rounds']} round(s):")
    short = {
        "plain": "plain",
        "copy_blocks": "blocks",
        "copy_blocks_consecutive": "blk-consec",
        KERNEL: "kernel",
        "index_select_copy": "isel+icopy",
        "index_select_out": "isel(out)",
    }
    kernel = KERNEL in bw["methods"]
    head = "".join(f"{short[m]:>11}" for m in bw["methods"])
    tail = f"{'kernel':>8}" if kernel else ""
    print(f"  {'dir':<4}{'blocks':>7}{head}{'ratio':>8}{'consec':>8}{tail}")
    for row in bw["rows"]:
        cells = "".join(f"{row['gb_s'][m]:11.2f}" for m in bw["methods"])
        last = f"{row['ratio_kernel']:7.2f}x" if kernel else ""
        print(
            f"  {row['direction']:<4}{row['blocks']:>7}{cells}"
            f"{row['ratio']:7.2f}x{row['ratio_consecutive']:7.2f}x{last}"
        )
    print(
        "  (ratio: copy_blocks scattered / plain; consec: copy_blocks consecutive / plain"
        + ("; kernel: copy_kernel scattered / plain)" if kernel else ")")
    )
    _verdict(bw["rows"], "copy_blocks", "ratio", "meets_target", TARGET_RATIO)
    if kernel:
        _verdict(bw["rows"], KERNEL, "ratio_kernel", "kernel_meets_target", KERNEL_TARGET_RATIO)
    h = report.get("harness")
    if h is not None:
        print(
            f"harness ({h['preset']}, {h['dtype']}, {h['programs']} programs x "
            f"{h['ops_per_program']} ops, pools of {h['device_blocks']} blocks, "
            f"OMP_NUM_THREADS={h['threads']}):"
        )
        for mode in MODES:
            r = h["reports"][mode]
            print(
                f"  {mode:<6}{h['ops_per_s'][mode]:9.1f} ops/s  ({r['ops']} ops in "
                f"{r['busy_s']:.2f} s; launch {r['launch_wall_s']:.1f} s)"
            )
        print(f"  fence / sync: {h['ratio']:.2f}x")
    print("(targets are informational)")


def _verdict(rows: list[dict[str, Any]], name: str, ratio: str, met: str, target: float) -> None:
    judged = [r for r in rows if r[met] is not None]
    if judged:
        worst = min(judged, key=lambda r: r[ratio])
        passed = all(r[met] for r in judged)
        print(
            f"{'PASS' if passed else 'FAIL'} {name} >= {target}x plain for batches of "
            f">= {TARGET_MIN_BLOCKS} blocks: lowest {worst[ratio]:.2f}x "
            f"({worst['direction']}, {worst['blocks']} blocks)"
        )


def main(args: argparse.Namespace) -> int:
    counts = resolve_counts(args, COUNTS)
    threads = args.threads or max(1, (os.cpu_count() or 1) // 4)
    preset = resolve_preset(args)
    import torch

    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise ValueError(f"--device: {args.device!r} is neither cpu nor cuda")
    if args.device != "cpu" and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: torch sees no CUDA device")
    batches = QUICK_BATCHES if args.quick else BATCHES
    start = time.perf_counter()
    bandwidth = bench_bandwidth(
        preset,
        batches,
        counts["rounds"],
        QUICK_REP_BLOCKS if args.quick else REP_BLOCKS,
        args.device,
        kernel=args.kernel,
    )
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "counts": counts,
        "bandwidth": bandwidth,
        "wall_s": {"bandwidth": round(time.perf_counter() - start, 3)},
    }
    if not args.skip_harness:
        start = time.perf_counter()
        try:
            report["harness"] = bench_harness(
                preset,
                counts["programs"],
                counts["ops"],
                threads,
                counts["timeout"],
                device=args.device,
            )
            report["wall_s"]["harness"] = round(time.perf_counter() - start, 3)
        except RunError as e:
            report["harness_error"] = str(e)  # what was measured is still written
    _print(report)
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    if "harness_error" in report:
        print(f"ringfence bench transfer: harness: {report['harness_error']}", file=sys.stderr)
        return 1
    return 0

"""``ringfence bench e2e``: whole workloads through the actor pipeline, pair by pair.

Each pair runs the same synthetic workload (its first ``--requests`` requests, all at
t=0: ``engine.arrivals=false``, so throughput is not bound by arrival times; multiturn
keeps its own arrivals, see below) under two
configurations that differ in one thing, and reports side A over side B:

1. ``fence/sync``: ``transfer.mode=fence`` vs ``sync`` on ``pressure``, swap-heavy: a
   device pool of about a quarter of what the requests need at once (so sequences are
   preempted) and ``sched.preemption=swap`` (so the swap lane carries blocks while steps
   run). Output-token throughput ratio; target >= 1.
   ``fence/lock``: the same against ``transfer.mode=lock``, the legacy design's lock
   around every step and every copy (actors/executors/legacy.py). Target >= 1.2.
   ``storage fence/sync`` and ``storage fence/lock``: storage-heavy, the same on
   ``pressure`` with ``sched.preemption=save`` and write-through to local storage
   (``cache.device_eviction=write_through``): every full block is stored, and a preempted
   sequence comes back from storage. ``redis fence/sync`` and ``redis fence/lock``: the
   same on a redis-server the bench starts (skipped where there is none; each launch
   starts on an empty database). Targets >= 1 and >= 1.2.
   ``block/poll``: ``runtime.wait=block`` (each idle actor sleeps on its doorbell) vs
   ``poll`` (the legacy design's pollers, a 1 ms sleep between looks) on the swap-heavy
   run. Throughput ratio (target >= 1.05) and the instance's CPU seconds per output
   token (every actor's ``cpu_s`` at stop, from ready), poll over block.
2. ``tiers multiturn``: the host tier and local storage on (``cache.host_blocks`` > 0,
   ``cache.storage.backend=local``) vs off (``host_blocks=0``, ``backend=none``) on
   ``multiturn`` with its arrivals (turns 2 s apart), on the same small device pool
   (evicted prefixes come back from the host tier instead of being recomputed).
   Throughput (arrival-bound) and TTFT p50 ratios (TTFT: B / A, so above 1 is better
   for the tiers); no target.
3. ``tiers unique``: the same on ``unique``, where nothing is reusable: what the tiers
   cost. Throughput ratio; target >= 0.97.
4. ``tiers chat``: the tiers on vs off on the long multi-round chat
   (``synthetic:chat``, 2x ``--requests`` turns with its arrivals, a 256-block device
   pool): throughput, and the TTFT p50 / p99 of the returning turns (turn 2 on), B / A
   (target >= 5 at p50). ``chat fence/sync`` and ``chat fence/lock``: the same chat,
   tiers on, fence against sync and against the legacy lock: throughput (targets >= 1
   and >= 1.2) and the returning turns' TTFTs.
5. ``actor/local``: the actor pipeline with the tiers off (pair 3's side B, the same
   launch) vs :class:`ringfence.actors.tools.testing.local.LocalRunner` in this process on the same
   workload and config: the control plane's cost. Throughput ratio; target >= 0.95.

Throughput is output tokens over the busy period: ``summary.json``'s ``duration_s`` for a
launch (from the workload's start, after the actors are up), the latest ``finish_s`` for
the local runner. Each launch is a real ``ringfence launch`` (supervisor, Engine, Worker,
swap and store lanes, each a process) in its own run dir under a temporary folder,
removed afterwards; every process gets ``OMP_NUM_THREADS=--threads`` (and the local
runner as many torch threads). The sides of each pair alternate, ``--rounds`` times;
figures are medians over the rounds, ratios are ratios of the medians. Each pair's
output tokens are compared request by request (round 1): with the KV bitwise the same,
they should all match; the fraction that does is reported, not asserted.

A failed launch (nonzero exit, timeout, no summary, an aborted request) is an error
(exit status 1); a missed target is printed as FAIL and is not.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

from ringfence.actors.tools.bench.e2e_pairs import DTYPE, TARGETS, Run, pairs
from ringfence.actors.tools.bench.e2e_remote import bench_remote, parse_delays, print_remote
from ringfence.actors.tools.bench.e2e_report import LATENCY, print_report, write_plot
from ringfence.actors.tools.bench.e2e_runs import (
    Side,
    cpu_per_token,
    flush_redis,
    median,
    percentile_of,
    ratio_of,
    returning_ttfts,
    run_launch,
    run_local,
    tokens_match,
)
from ringfence.actors.tools.bench.launcher import RunError
from ringfence.actors.tools.bench.options import (
    add_counts,
    environment,
    plot_path,
    resolve_counts,
    resolve_preset,
)

# name: (default, quick default, help)
COUNTS: dict[str, tuple[int, int, str]] = {
    "rounds": (1, 1, "rounds of every pair, sides alternating"),
    "requests": (8, 3, "requests of each workload"),
    "timeout": (300, 120, "seconds each launch may take"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument("--quick", action="store_true", help="tiny preset, a few requests (tests)")
    parser.add_argument("--preset", help="model preset (small; quick: tiny)")
    add_counts(parser, COUNTS)
    parser.add_argument(
        "--threads", type=int, help="OMP_NUM_THREADS of every process (CPUs / 4, at least 1)"
    )
    parser.add_argument(
        "--plot", type=Path, metavar="FILE", help="the PNG (next to --json, else bench-e2e.png)"
    )
    parser.add_argument(
        "--remote",
        metavar="MS,...",
        help="also fence, lock and sync with storage on a redis this many ms away, one way "
        "(a delay proxy the bench starts; 0: on loopback), e.g. 0,0.5,2,5",
    )
    parser.add_argument(
        "--remote-mbps", type=float, metavar="MBPS", help="the remote link's bandwidth (none)"
    )
    parser.add_argument(
        "--remote-only", action="store_true", help="only the --remote family, not the pairs"
    )


def bench(preset: str, requests: int, rounds: int, threads: int, timeout: float) -> dict[str, Any]:
    """Every pair's sides, ``rounds`` times alternating, and the ratios of their medians.
    The redis pairs run on a redis-server started here, where one is on PATH."""
    from ringfence.actors.tools.testing.redis_server import REDIS_SERVER, redis_server

    skipped: list[str] = []
    with (
        tempfile.TemporaryDirectory(prefix="rf-bench-e2e-") as tmp,
        contextlib.ExitStack() as servers,
    ):
        folder = Path(tmp)
        redis_url = None
        if REDIS_SERVER is None:
            skipped.append("redis fence/sync and fence/lock: redis-server is not on PATH")
        else:
            (folder / "redis").mkdir()
            redis_url = servers.enter_context(redis_server(folder / "redis"))
        launched = pairs(preset, requests, redis_url)
        sides: dict[str, tuple[list[Side], list[Side]]] = {
            name: ([], []) for name in [*launched, "actor/local"]
        }

        def launch(run: Run) -> Side:
            if redis_url is not None and f"cache.storage.url={redis_url}" in run.settings:
                flush_redis(redis_url)
            return run_launch(run, threads=threads, timeout=timeout, folder=folder)

        for round_no in range(rounds):
            for name, (a, b) in launched.items():
                order: list[tuple[int, Run]] = [(0, a), (1, b)]
                for index, run in order if round_no % 2 == 0 else order[::-1]:
                    sides[name][index].append(launch(run))
            # The control plane: pair 3's tiers-off launch against the same run in process.
            sides["actor/local"][0].append(sides["tiers unique"][1][-1])
            sides["actor/local"][1].append(run_local(launched["tiers unique"][1], threads=threads))
    rows = []
    for name, (a_runs, b_runs) in sides.items():
        a_tps = median([s.output_tokens_per_s for s in a_runs])
        b_tps = median([s.output_tokens_per_s for s in b_runs])
        rows.append(
            _row(
                name,
                unit="tokens/s",
                a=a_tps,
                b=b_tps,
                ratio=ratio_of(a_tps, b_tps),
                a_runs=a_runs,
                b_runs=b_runs,
            )
        )
        lower_is_better: list[tuple[str, str, Callable[[Side], float | None], float]] = []
        if name == "block/poll":
            lower_is_better.append(("cpu per token", "CPU ms/tok", cpu_per_token, 1e3))
        for q, pct in (("p50", 50), ("p99", 99)):
            if name == "tiers chat" or name.startswith("chat fence/"):

                def returning(s: Side, pct: float = pct) -> float | None:
                    return percentile_of(returning_ttfts(s), pct)

                lower_is_better.append((f"returning ttft {q}", f"TTFT {q} s", returning, 1.0))
            if name == "tiers multiturn":

                def ttft(s: Side, q: str = q) -> float | None:
                    value: float | None = getattr(s, f"ttft_{q}_s")
                    return value

                lower_is_better.append((f"ttft {q}", f"TTFT {q} s", ttft, 1.0))
        for suffix, unit, figure, scale in lower_is_better:  # the ratio is B / A
            a_fig = median([figure(s) for s in a_runs])
            b_fig = median([figure(s) for s in b_runs])
            rows.append(
                _row(
                    f"{name} {suffix}",
                    unit=unit,
                    a=None if a_fig is None else a_fig * scale,
                    b=None if b_fig is None else b_fig * scale,
                    ratio=ratio_of(b_fig, a_fig),
                    a_runs=[],
                    b_runs=[],
                )
            )
    runs = {name: [list(r.settings) for r in pair] for name, pair in launched.items()}
    return {"rows": rows, "runs": runs, "skipped": skipped}


def _row(
    name: str,
    *,
    unit: str,
    a: float | None,
    b: float | None,
    ratio: float | None,
    a_runs: Sequence[Side],
    b_runs: Sequence[Side],
) -> dict[str, Any]:
    target = TARGETS[name]
    row: dict[str, Any] = {
        "name": name,
        "unit": unit,
        "a": a,
        "b": b,
        "ratio": ratio,
        "target": target,
        "meets_target": None if target is None else ratio is not None and ratio >= target,
    }
    if "fence/" in name and a_runs:  # the ordering pairs: what they do to latency
        row["latency"] = {
            key: [median([getattr(s, key) for s in runs]) for runs in (a_runs, b_runs)]
            for key in LATENCY
        }
    if a_runs:
        row["tokens_match"] = tokens_match(a_runs[0], b_runs[0])
        row["sides"] = [
            [
                {
                    "output_tokens_per_s": s.output_tokens_per_s,
                    "ttft_p50_s": s.ttft_p50_s,
                    "ttft_p99_s": s.ttft_p99_s,
                    "tpot_p99_s": s.tpot_p99_s,
                    "duration_s": s.duration_s,
                    "wall_s": round(s.wall_s, 3),
                    "cpu_s": s.cpu_s,
                    "engine": s.engine,
                }
                for s in runs
            ]
            for runs in (a_runs, b_runs)
        ]
    return row


def main(args: argparse.Namespace) -> int:
    counts = resolve_counts(args, COUNTS)
    preset = resolve_preset(args)
    threads = args.threads or max(1, (os.cpu_count() or 1) // 4)
    delays = None if args.remote is None else parse_delays(args.remote)
    if args.remote_only and delays is None:
        raise ValueError("--remote-only: give the delays with --remote")
    if args.remote_mbps is not None and args.remote_mbps <= 0:
        raise ValueError(f"--remote-mbps: {args.remote_mbps} must be > 0")
    import torch

    start = time.perf_counter()
    figures: dict[str, Any] = {"rows": [], "runs": {}, "skipped": []}
    try:
        if not args.remote_only:
            figures = bench(
                preset, counts["requests"], counts["rounds"], threads, counts["timeout"]
            )
        if delays is not None:
            figures["remote"] = bench_remote(
                preset, counts["requests"], counts["rounds"], threads=threads,
                timeout=counts["timeout"], delays_ms=delays, mbps=args.remote_mbps,
            )  # fmt: skip
    except RunError as e:
        print(f"ringfence bench e2e: {e}", file=sys.stderr)
        return 1
    report: dict[str, Any] = {
        "torch": torch.__version__,
        **environment(),
        "threads": threads,
        "preset": preset,
        "dtype": DTYPE,
        "counts": counts,
        **figures,
        "wall_s": round(time.perf_counter() - start, 3),
    }
    if report["rows"]:
        print_report(report)
        plot = plot_path(args, "bench-e2e.png")
        write_plot(report, plot)
        report["plot"] = str(plot)
    if "remote" in report:
        print_remote(report["remote"])
    if args.json is not None:
        Path(args.json).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0

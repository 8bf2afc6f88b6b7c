"""The bandwidth half of ``ringfence bench transfer``: KV blocks copied between the host tier
and the device tier by each method, over the same block ids, and each method's GB/s per
batch size and direction (see :mod:`ringfence.actors.tools.bench.transfer`, part 1).

Rounds come after one untimed warm-up round; in each round every batch size and direction
runs every method in a rotated order, so drift affects all alike; figures are medians over
the rounds.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ringfence.actors.tools.bench.transfer_harness import BLOCK_SIZE, DTYPE

if TYPE_CHECKING:
    from torch import Tensor

TARGET_RATIO = 0.7
KERNEL_TARGET_RATIO = 0.8
TARGET_MIN_BLOCKS = 64  # the targets apply to batches of this many blocks and more
BATCHES = (1, 4, 16, 64, 256, 1024)
QUICK_BATCHES = (1, 4, 16, 64)
REP_BLOCKS = 256  # a timed sample copies at least this many blocks (small batches repeat)
QUICK_REP_BLOCKS = 64
METHODS = (
    "plain",
    "copy_blocks",
    "copy_blocks_consecutive",
    "index_select_copy",
    "index_select_out",
)
# On a CUDA device, the runtime's own path and its ceiling: the index_select methods stage
# through a tensor on one side, which is a CPU design question.
CUDA_METHODS = METHODS[:3]
KERNEL = "copy_kernel"  # the batched kernel: on CUDA with Triton, on the CPU when asked
DIRECTIONS = ("h2d", "d2h")
SEED = 0


class _Pools:
    """The host (shared-memory) and device tensors, a staging tensor, and the timed methods."""

    def __init__(self, host: Tensor, device: Tensor, staging: Tensor) -> None:
        self.host, self.device, self.staging = host, device, staging
        self.blocks = host.shape[0]
        self.cuda = device.is_cuda  # copies queued (non_blocking), waited for by timed()

    def timed(
        self, method: str, direction: str, batches: Sequence[tuple[list[int], list[int]]]
    ) -> float:
        """Seconds :meth:`run` takes, to the end of the copies it queued on a CUDA device."""
        import torch

        start = time.perf_counter()
        self.run(method, direction, batches)
        if self.cuda:
            torch.cuda.synchronize(self.device.device)
        return time.perf_counter() - start

    def ends(self, direction: str) -> tuple[Tensor, Tensor]:
        return (self.host, self.device) if direction == "h2d" else (self.device, self.host)

    def run(
        self, method: str, direction: str, batches: Sequence[tuple[list[int], list[int]]]
    ) -> None:
        """Copy every ``(src_ids, dst_ids)`` batch with ``method``."""
        import torch

        from ringfence.actors.kv.copies import copy_blocks

        src, dst = self.ends(direction)
        for src_ids, dst_ids in batches:
            n = len(src_ids)
            if method == "plain":
                a, b = src_ids[0], dst_ids[0]  # the consecutive ids' starts
                dst[b : b + n].copy_(src[a : a + n], non_blocking=self.cuda)
            elif method == "copy_blocks":
                copy_blocks(src, src_ids, dst, dst_ids, non_blocking=self.cuda)
            elif method == "copy_blocks_consecutive":
                a, b = src_ids[0], dst_ids[0]
                copy_blocks(src, range(a, a + n), dst, range(b, b + n), non_blocking=self.cuda)
            elif method == KERNEL:
                copy_blocks(src, src_ids, dst, dst_ids, non_blocking=self.cuda, method="kernel")
            elif method == "index_select_copy":
                s, d = torch.tensor(src_ids), torch.tensor(dst_ids)
                dst.index_copy_(0, d, torch.index_select(src, 0, s))
            elif method == "index_select_out":
                s, d = torch.tensor(src_ids), torch.tensor(dst_ids)
                out = self.staging[:n]
                torch.index_select(src, 0, s, out=out)
                dst.index_copy_(0, d, out)
            else:
                raise ValueError(f"unknown method {method!r}")


def _draw(
    rng: random.Random, blocks: int, n: int, reps: int
) -> dict[str, list[tuple[list[int], list[int]]]]:
    """Block ids of ``reps`` calls of ``n`` blocks: scattered ids, and consecutive runs
    (given by their first ids, which is all ``plain`` and the consecutive variant read)."""
    scattered = [(rng.sample(range(blocks), n), rng.sample(range(blocks), n)) for _ in range(reps)]
    starts = [
        ([rng.randrange(blocks - n + 1)], [rng.randrange(blocks - n + 1)]) for _ in range(reps)
    ]
    consecutive = [(list(range(a[0], a[0] + n)), list(range(b[0], b[0] + n))) for a, b in starts]
    return {
        "plain": consecutive,
        "copy_blocks": scattered,
        "copy_blocks_consecutive": consecutive,
        KERNEL: scattered,
        "index_select_copy": scattered,
        "index_select_out": scattered,
    }


def bench_methods(device: str, kernel: bool) -> tuple[str, ...]:
    """The methods timed on ``device``: the kernel where it runs at its own pace (CUDA with
    Triton installed) or where ``kernel`` asks for it (ValueError naming --kernel where it
    cannot run)."""
    from ringfence.actors.model.kernels import triton_available

    methods = METHODS if device == "cpu" else CUDA_METHODS
    if kernel and not triton_available():
        raise ValueError("--kernel: Triton is not installed (the test extra installs it)")
    if kernel and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("--kernel on the CPU: Triton runs there only with TRITON_INTERPRET=1")
    if kernel or (device != "cpu" and triton_available()):
        methods = (*methods, KERNEL)
    return methods


def bench_bandwidth(
    preset: str,
    batches: Sequence[int],
    rounds: int,
    rep_blocks: int,
    device: str = "cpu",
    *,
    kernel: bool = False,
) -> dict[str, Any]:
    """Median GB/s of every method, direction and batch size, and the copy_blocks and
    kernel ratios; the device tier on ``device`` (on CUDA the host tier is pinned as the
    swap lane pins it); the kernel timed as :func:`bench_methods` says."""
    import torch

    from ringfence.actors.kv.copies import HOST_MAPPED
    from ringfence.actors.kv.space import KVLayout, create_kv
    from ringfence.actors.model.decoder import PRESETS
    from ringfence.shm import names

    shape = PRESETS[preset]
    pool = max(batches)
    layout = KVLayout(
        num_blocks=pool,
        layers=shape.layers,
        block_size=BLOCK_SIZE,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        dtype=DTYPE,
    )
    run_id = names.new_run_id()
    methods = bench_methods(device, kernel)
    seconds: dict[str, dict[int, dict[str, list[float]]]] = {
        d: {n: {m: [] for m in methods} for n in batches} for d in DIRECTIONS
    }
    try:
        host_kv = create_kv(layout, "cpu", shm_name=names.posix_name(run_id, "kv.host.0"))
        pinned = False
        try:
            host = host_kv.kv
            if device != "cpu":
                nbytes = host.numel() * host.element_size()
                flags = HOST_MAPPED if KERNEL in methods else 0
                with torch.cuda.device(device):
                    code = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), nbytes, flags)  # type: ignore[no-untyped-call]
                if int(code) != 0:
                    raise RuntimeError(f"cudaHostRegister of the host tensor failed: {code}")
                pinned = True
            dev = torch.empty(layout.shape, dtype=layout.torch_dtype, device=device)
            staging = torch.empty(layout.shape, dtype=layout.torch_dtype)
            for t in (host, dev, staging):  # first touch, outside any timing
                t.fill_(1.0)
            pools = _Pools(host, dev, staging)
            rng = random.Random(SEED)
            for round_no in range(rounds + 1):  # round 0 warms up, untimed
                for n in batches:
                    reps = max(1, rep_blocks // n)
                    for direction in DIRECTIONS:
                        ids = _draw(rng, pool, n, reps)
                        shift = (round_no + n) % len(methods)
                        for method in methods[shift:] + methods[:shift]:
                            elapsed = pools.timed(method, direction, ids[method])
                            if round_no:
                                seconds[direction][n][method].append(elapsed / reps)
        finally:
            if pinned:
                torch.cuda.cudart().cudaHostUnregister(host_kv.kv.data_ptr())  # type: ignore[no-untyped-call]
            host_kv.close()
    finally:
        names.clean_run(run_id)
    rows = [
        _row(direction, n, n * layout.block_bytes, seconds[direction][n])
        for direction in DIRECTIONS
        for n in batches
    ]
    return {
        "preset": preset,
        "dtype": DTYPE,
        "block_size": BLOCK_SIZE,
        "block_bytes": layout.block_bytes,
        "pool_blocks": pool,
        "batches": list(batches),
        "rounds": rounds,
        "rep_blocks": rep_blocks,
        "device": device if device == "cpu" else torch.cuda.get_device_name(device),
        "methods": list(methods),
        "rows": rows,
        "target_ratio": TARGET_RATIO,
        "kernel_target_ratio": KERNEL_TARGET_RATIO,
        "target_min_blocks": TARGET_MIN_BLOCKS,
    }


def _row(direction: str, n: int, nbytes: int, seconds: dict[str, list[float]]) -> dict[str, Any]:
    """One direction and batch size: each method's median GB/s, the ratios, the targets."""
    gb_s = {m: nbytes / statistics.median(s) / 1e9 for m, s in seconds.items()}
    scattered = gb_s["copy_blocks"] / gb_s["plain"]
    judged = n >= TARGET_MIN_BLOCKS
    row: dict[str, Any] = {
        "direction": direction,
        "blocks": n,
        "bytes": nbytes,
        "gb_s": gb_s,
        "ratio": scattered,
        "ratio_consecutive": gb_s["copy_blocks_consecutive"] / gb_s["plain"],
        "meets_target": scattered >= TARGET_RATIO if judged else None,
    }
    if KERNEL in gb_s:
        kernel = gb_s[KERNEL] / gb_s["plain"]
        row["ratio_kernel"] = kernel
        row["kernel_meets_target"] = kernel >= KERNEL_TARGET_RATIO if judged else None
    return row

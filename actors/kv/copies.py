"""Copying whole KV blocks between two block-major tensors, straight from block to block.

A block is one contiguous run of bytes, so ``n`` blocks that are consecutive in both
the source and the destination are one contiguous copy. :func:`copy_blocks` splits a
list of block pairs into such runs and copies each with one ``copy_``: a plain memcpy
for long runs, a per-block copy for scattered ids. Nothing is copied through a freshly
allocated temporary (first-touch page faults made ``index_select`` into a new tensor
run at 0.7-4.7 GB/s on this kind of machine, against 7-16 GB/s for per-block copies;
``ringfence bench transfer`` measures the methods side by side).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

from torch import Tensor


def block_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs ``(src_start, dst_start, count)`` consecutive on both sides, in order."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def copy_blocks(
    src: Tensor,
    src_ids: Sequence[int],
    dst: Tensor,
    dst_ids: Sequence[int],
    *,
    non_blocking: bool = False,
) -> int:
    """Copy block ``src_ids[i]`` of ``src`` onto block ``dst_ids[i]`` of ``dst``; bytes copied.

    Both tensors are block-major with equal block shapes and dtypes. On CUDA with
    ``non_blocking`` the copies are queued on the current stream (the caller records
    and waits for an event before it publishes them done).
    """
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(
            f"blocks differ: {tuple(src.shape[1:])} {src.dtype} vs {tuple(dst.shape[1:])} "
            f"{dst.dtype}"
        )
    for s, d, n in block_runs(src_ids, dst_ids):
        dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)
    return len(src_ids) * src[0].numel() * src.element_size()


def block_buffer(kv: Tensor, block: int) -> memoryview:
    """A writable byte view of one block of a CPU tensor (for storage I/O, no copy).

    Valid while ``kv`` lives; the caller keeps it alive for the duration of the I/O.
    """
    if kv.device.type != "cpu":
        raise ValueError("storage I/O goes through the host tier: a CPU tensor")
    one = kv[block]
    nbytes = one.numel() * one.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(one.data_ptr())).cast("B")

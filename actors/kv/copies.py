"""Copying whole KV blocks between two block-major tensors, straight from block to block.

A block is one contiguous run of bytes, so ``n`` blocks that are consecutive in both
the source and the destination are one contiguous copy. :func:`copy_blocks` copies a list
of block pairs by one of two methods (``transfer.copy``, :func:`resolve_copy`):

- ``runs``: the pairs split into such runs, each copied with one ``copy_``: a plain memcpy
  for long runs, a per-block copy for scattered ids. The CPU's method: nothing is copied
  through a freshly allocated temporary (first-touch page faults made ``index_select`` into
  a new tensor run at 0.7-4.7 GB/s on this kind of machine, against 7-16 GB/s for
  per-block copies). On a GPU, one ``copy_`` a block reached 0.34-0.56x of one contiguous
  copy's bandwidth for scattered blocks (H100, H200).
- ``kernel``: one Triton kernel launch copies every pair (``block_kernel.py``), on CUDA
  reading or writing the host tier in place through its mapping into the device's address
  space (the host tier registered with :data:`HOST_MAPPED`). ``auto`` picks it on CUDA.

``ringfence bench transfer`` measures the methods side by side.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from ringfence.actors.model.kernels import triton_available

CopyMethod = Literal["runs", "kernel"]
# cudaHostRegister's flags for the host tier: cudaHostRegisterPortable (pinned for every
# context) | cudaHostRegisterMapped (mapped into the device's address space, so a kernel
# reads and writes it in place). The runs need neither: 0, the default flags.
HOST_MAPPED = 3


def resolve_copy(choice: str, device: torch.device) -> CopyMethod:
    """The method ``transfer.copy`` (``auto``, ``runs`` or ``kernel``) means for a device tier
    on ``device``: ``auto`` is the kernel on CUDA with Triton installed, else the runs;
    ``kernel`` without Triton, or on a CPU outside Triton's interpreter, is a ValueError
    naming the setting, and so is any other value."""
    if choice == "runs":
        return "runs"
    if choice == "kernel":
        if not triton_available():
            raise ValueError(
                "transfer.copy is 'kernel' but Triton is not installed (pip install triton, "
                "or transfer.copy=runs)"
            )
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"transfer.copy is 'kernel' with the device tier on {device}: Triton runs there "
                "only in its interpreter (TRITON_INTERPRET=1, set by default where no CUDA "
                "device is present)"
            )
        return "kernel"
    if choice != "auto":
        raise ValueError(f"transfer.copy must be auto, runs or kernel, got {choice!r}")
    return "kernel" if device.type == "cuda" and triton_available() else "runs"


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
    method: CopyMethod = "runs",
) -> int:
    """Copy block ``src_ids[i]`` of ``src`` onto block ``dst_ids[i]`` of ``dst``; bytes copied.

    Both tensors are block-major with equal block shapes and dtypes; the destination ids
    are distinct. On CUDA with ``non_blocking`` the copies are queued on the current stream
    (the caller records and waits for an event before it publishes them done); without it
    they are done when this returns. ``method``: the module docstring's; the same bytes
    land either way.
    """
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(
            f"blocks differ: {tuple(src.shape[1:])} {src.dtype} vs {tuple(dst.shape[1:])} "
            f"{dst.dtype}"
        )
    if method == "kernel":
        from ringfence.actors.kv.block_kernel import copy_scattered  # imports Triton

        copy_scattered(src, src_ids, dst, dst_ids)
        if not non_blocking and (src.is_cuda or dst.is_cuda):
            torch.cuda.current_stream(dst.device if dst.is_cuda else src.device).synchronize()
    else:
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

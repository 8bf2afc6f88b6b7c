"""One launch copies N scattered KV blocks: a Triton kernel over (block pair, chunk of a block).

Both tensors are block-major and contiguous, so a block is ``block_bytes`` contiguous bytes
(``actors/kv/space.py``). The kernel sees each tensor as rows of words, one row a block, the
word the widest integer that divides the block (int64 unless the block's bytes are not a
multiple of 8), and copies row ``src_ids[i]`` onto row ``dst_ids[i]`` for every ``i`` in one
launch. Program ``(i, c)`` copies chunk ``c`` of pair ``i``: ``CHUNK`` words, contiguous and
16-byte aligned, so the loads and stores are wide vector ones. Words are integers, so every
dtype copies exactly, a NaN's payload included (a float copy may quiet a signalling NaN).

On CUDA one side is the host tier: the swap lane registers it with ``cudaHostRegister``,
mapped into the device's address space (``copies.HOST_MAPPED``). :func:`device_rows` makes a
CUDA tensor over that same memory, no copy: an object with ``__cuda_array_interface__`` on
the host tensor's address, given to ``torch.as_tensor`` (torch asks the driver which device
the pointer belongs to; registered host memory is accepted, unregistered memory refused).
The kernel then reads or writes the host tier over PCIe directly (zero-copy), and Triton's
launcher translates the address into the device pointer of the mapping (it refuses, "cannot
be accessed from Triton", memory that is not mapped). The launch is queued on the current
CUDA stream, like the per-run copies with ``non_blocking``.

What is verified, and where. On the CPU (Triton's interpreter, CPU tensors on both sides):
the kernel's indexing, chunking and tails, every KV dtype bit for bit, NaN payloads, blocks
not named left untouched (``tests/actors/kv/test_block_kernel.py``); that the kernel
compiles for sm_90 (PTX and a cubin) without a GPU. Not verified without a GPU, and what a
GPU session checks (the same test file, whose CUDA tests ``scripts/device-check`` runs in
its step A1, and ``ringfence bench transfer --device cuda`` in its step D): that
``torch.as_tensor`` on the mapped host tier aliases it (same address, no copy), the copies
in both directions between a CUDA tensor and the registered host tier equal the per-run
copies, and the bandwidth against one contiguous copy (target 0.8x at 64 blocks and more).
The kernel occupies SMs while it runs, where ``copy_`` uses a copy engine: how it shares
the GPU with the Worker's kernels is measured there too, not assumed.

This module imports Triton; :mod:`ringfence.actors.kv.copies` imports it only for the kernel.
"""

# Triton ships no type information: its decorator and the kernel's arguments are untyped.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

if not torch.cuda.is_available():  # Triton's interpreter on the CPU (kernels/__init__.py: why)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # after the variable above: Triton reads it at import
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
CHUNK_BYTES = 16384  # bytes one program copies: 128 bytes a thread at NUM_WARPS 4
NUM_WARPS = 4
# The word a block is viewed as, widest first: (bytes, torch dtype, __cuda_array_interface__).
WORD_TYPES = ((8, torch.int64, "<i8"), (4, torch.int32, "<i4"), (2, torch.int16, "<i2"))
BYTE = (1, torch.uint8, "|u1")


@triton.jit
def _copy_blocks(src_ptr, dst_ptr, pairs_ptr, WORDS: tl.constexpr, CHUNK: tl.constexpr):
    # pairs: [N, 2] int32 (source block, destination block), so one pointer whatever N is.
    pair = tl.program_id(0)
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64)
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64)
    offsets = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    inside = offsets < WORDS
    words = tl.load(src_ptr + src * WORDS + offsets, mask=inside)
    tl.store(dst_ptr + dst * WORDS + offsets, words, mask=inside)


def word_of(block_bytes: int) -> tuple[int, torch.dtype, str]:
    """(bytes, dtype, typestr) of the widest integer word that divides a block."""
    for word in WORD_TYPES:
        if block_bytes % word[0] == 0:
            return word
    return BYTE


class _HostMemory:
    """A CUDA array interface on registered host memory; keeps the host tensor alive."""

    def __init__(self, host: Tensor, shape: tuple[int, int], typestr: str) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 3,
            "stream": None,  # nothing to order: no stream writes the host memory
        }


def device_rows(kv: Tensor, device: torch.device) -> Tensor:
    """``kv`` as ``[num_blocks, words]`` integers on ``device``, aliasing its memory.

    A tensor already on ``device`` is viewed. A CPU tensor next to a CUDA ``device`` must be
    registered with CUDA and mapped (``copies.HOST_MAPPED``): its rows are a CUDA tensor on
    the same memory; RuntimeError when torch made a copy instead (the host memory belongs to
    another device: register it with that device current, or portable). Valid while ``kv``
    lives and stays registered.
    """
    if not kv.is_contiguous():
        raise ValueError("the block kernel copies whole rows of a contiguous block-major tensor")
    block_bytes = kv[0].numel() * kv.element_size() if kv.shape[0] else 0
    nbytes, dtype, typestr = word_of(block_bytes)
    shape = (kv.shape[0], block_bytes // nbytes)
    if kv.device == device:
        return kv.view(torch.uint8).view(-1).view(dtype).view(shape)
    if kv.device.type != "cpu" or device.type != "cuda":
        raise ValueError(f"blocks on {kv.device} cannot be copied by a kernel on {device}")
    rows = torch.as_tensor(_HostMemory(kv, shape, typestr), device=device)
    if rows.data_ptr() != kv.data_ptr():
        raise RuntimeError(
            f"the host tier is not mapped for {device}: torch copied it instead of viewing it"
        )
    return rows


def copy_scattered(
    src: Tensor, src_ids: Sequence[int], dst: Tensor, dst_ids: Sequence[int], *, chunk: int = 0
) -> None:
    """Copy block ``src_ids[i]`` of ``src`` onto block ``dst_ids[i]`` of ``dst``, all in one
    launch on the current stream (on CUDA it returns before the copy is done).

    The kernel runs on the CUDA device of either tensor (the other: the registered host
    tier), or in Triton's interpreter when both are CPU tensors. The destination ids must
    be distinct (the programs run in no order); every id must name a block. ``chunk``:
    words a program copies (a power of two; 0: ``CHUNK_BYTES`` worth, at most a block).
    Mutates only the named blocks of ``dst``.
    """
    n = len(src_ids)
    if n != len(dst_ids):
        raise ValueError(f"{n} source blocks but {len(dst_ids)} destination blocks")
    if len(set(dst_ids)) != n:
        raise ValueError("a destination block is named twice")
    ends = (("source", src_ids, src.shape[0]), ("destination", dst_ids, dst.shape[0]))
    for name, ids, count in ends:  # an id past the tensor would be a write past its memory
        if n and not (min(ids) >= 0 and max(ids) < count):
            raise ValueError(f"a {name} block id is outside the tensor's {count} blocks")
    if not n:
        return
    device = dst.device if dst.is_cuda else src.device
    src_rows, dst_rows = device_rows(src, device), device_rows(dst, device)
    shape = _shape(src_rows, chunk)
    pairs = torch.tensor([[s, d] for s, d in zip(src_ids, dst_ids, strict=True)], dtype=torch.int32)
    grid = (n, triton.cdiv(shape["WORDS"], shape["CHUNK"]))
    if device.type != "cuda":
        _copy_blocks[grid](src_rows, dst_rows, pairs, **shape)
        return
    with torch.cuda.device(device):  # Triton launches on the current device's current stream
        pairs = pairs.to(device, non_blocking=True)  # ordered before the launch on that stream
        _copy_blocks[grid](src_rows, dst_rows, pairs, **shape)


def _shape(rows: Tensor, chunk: int = 0) -> dict[str, Any]:
    """The kernel's constants for blocks of ``rows``: the words of a block, the words of a
    program (``chunk``, or ``CHUNK_BYTES`` worth, at most a block's), its warps."""
    words = rows.shape[1]
    if not chunk:
        chunk = min(max(CHUNK_BYTES // rows.element_size(), 1), triton.next_power_of_2(words))
    return {"WORDS": words, "CHUNK": chunk, "num_warps": NUM_WARPS}


def compile_for(kv: Tensor, device: torch.device) -> None:
    """Compile the kernel for ``kv``'s blocks on ``device`` ahead of the first copy (the
    swap lane's first swap would wait seconds for it). Nothing is launched; a no-op in the
    interpreter."""
    if INTERPRETED:
        return
    rows = device_rows(kv, device)
    pairs = torch.zeros(1, 2, dtype=torch.int32, device=device)
    with torch.cuda.device(device):  # Triton compiles for the current device
        _copy_blocks.warmup(rows, rows, pairs, grid=(1, 1), **_shape(rows))

"""Attention over a context's keys shared out among programs, and their outputs merged.

The paged attention kernel (``paged_attention.py``) runs one program per (piece, KV head)
and reads that piece's keys in order. A decode step of one sequence on a 16-layer model of 8
KV heads is then 8 programs a layer on a GPU of 132 multiprocessors, each reading the whole
context alone: at long contexts the step is a few programs' latency, not the device's
bandwidth. Splitting the keys (as vLLM's and SGLang's decode kernels do, "flash-decoding")
runs ``splits`` programs per (piece, KV head), each over its own run of whole tiles of at
least ``split_keys`` keys. Each writes its rows' output normalised by its own softmax sum,
and that sum's log (base 2, as the kernel's scores are). :func:`merge_splits` then weighs
the shares by their sums, in one program per (token, head).

A share with no key a row may see (past a short context's end, or a padding row's) has a
log-sum of -inf and weighs nothing; a row no share saw is zero, as the unsplit kernel
leaves it. The merge adds one rounding of the output in the accumulator's dtype (float32,
float64 for float64 KV), so a split step's output equals the unsplit one's to that rounding.

:func:`split_count` picks ``splits`` for a step: enough programs to keep about two per
multiprocessor busy, no more than :data:`MOST_SPLITS`, and none for a step that already has
that many programs (a batch of 64 decodes of 8 KV heads is 512). The kernel itself uses
fewer shares for a context shorter than ``splits * split_keys``, so a CUDA graph captured
with its bucket's ``splits`` serves every context longer than one share (``graphs.py``
replays the bucket's whole graph for shorter ones: no merge).
"""

# Triton's kernels take untyped pointers and its decorator is untyped.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import Tensor

if not torch.cuda.is_available():  # Triton's interpreter on the CPU (kernels/__init__.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl

MOST_SPLITS = 16
SPLIT_KEYS = 256  # the fewest keys of a share on a GPU: 8 tiles of the kernel's 32 keys
PROGRAMS_PER_SM = 2


class Partials(NamedTuple):
    """Where a split step's shares land, for :func:`merge_splits` (made per step, used by
    every layer in turn: the layers run in order on one stream)."""

    part: Tensor  # [T, heads, splits, head_dim]: each share's output, normalised
    lse: Tensor  # [T, heads, splits]: log2 of each share's softmax sum, -inf where none

    @classmethod
    def empty(cls, q: Tensor, splits: int, dtype: torch.dtype) -> Partials:
        """Room for ``splits`` shares of each row of q ``[T, heads, head_dim]``, in ``dtype``
        (:func:`acc_dtype`) on q's device."""
        tokens, heads, head_dim = q.shape
        part = torch.empty(tokens, heads, splits, head_dim, dtype=dtype, device=q.device)
        return cls(part, torch.empty(tokens, heads, splits, dtype=dtype, device=q.device))


def acc_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernel accumulates in, and the shares are kept in."""
    return torch.float64 if kv_dtype == torch.float64 else torch.float32


def decode_keys(starts: Iterable[int], window: int | None) -> int:
    """The most keys a decode at one of ``starts`` (its position) sees: its position and all
    before it, or the last ``window`` of them."""
    keys = max(start + 1 for start in starts)
    return keys if window is None else min(keys, window)


@functools.cache
def _multiprocessors(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def split_count(programs: int, longest: int, device: torch.device, most: int = MOST_SPLITS) -> int:
    """Shares per (piece, KV head) for a decode step of ``programs`` programs unsplit whose
    longest context may be ``longest`` keys, on ``device``, at most ``most`` (the module
    docstring). 1 off a GPU: the interpreter's programs run one after another."""
    if device.type != "cuda" or most <= 1 or programs <= 0:
        return 1
    busy = PROGRAMS_PER_SM * _multiprocessors(device.index or 0)
    return max(1, min(most, -(-busy // programs), -(-longest // SPLIT_KEYS)))


@triton.jit
def share_of(lo, hi, splits, split_keys, TILE: tl.constexpr):
    """Keys ``lo..hi-1`` of this program's share (grid axis 2, of ``splits``) of
    ``lo..hi-1``: whole tiles counted from lo's, at least ``split_keys`` keys a share; empty
    past the last key."""
    base = (lo // TILE) * TILE
    share = tl.cdiv(tl.maximum(tl.cdiv(hi - base, splits), split_keys), TILE) * TILE
    first = base + tl.program_id(2) * share
    return tl.maximum(first, lo), tl.minimum(first + share, hi)


@triton.jit
def store_share(  # noqa: PLR0917
    part_ptr, lse_ptr, out, m_i, l_i, rows, head, row_ok, dims, dim_ok,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
):  # fmt: skip
    """This program's share of its rows (``rows``, ``head``: their token and head) for
    :func:`merge_splits`: the normalised output ``out`` and log2 of the softmax sum (``m_i``
    the running max, in the scores' log2 units; ``l_i`` the sum), -inf where it saw no key."""
    share = tl.program_id(2)
    part_at = rows[:, None] * stride_pt + head[:, None] * stride_ph + share * stride_ps
    tl.store(
        part_ptr + part_at + dims[None, :],
        out.to(part_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.math.log2(tl.maximum(l_i, 1e-30)))
    lse_at = rows * stride_lt + head * stride_lh + share
    tl.store(lse_ptr + lse_at, lse.to(lse_ptr.dtype.element_ty), mask=row_ok)


@triton.jit(do_not_specialize=["splits"])
def _merge_splits(  # noqa: PLR0917
    part_ptr, lse_ptr, out_ptr, splits, stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    stride_ot, stride_oh, stride_od,
    SPLITS_P: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    shares = tl.arange(0, SPLITS_P)
    share_ok = shares < splits
    dims = tl.arange(0, HEAD_P)
    dim_ok = dims < HEAD_DIM
    lse = tl.load(
        lse_ptr + token * stride_lt + head * stride_lh + shares, mask=share_ok, other=float("-inf")
    )
    top = tl.max(lse, axis=0)
    weight = tl.math.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # 0 where -inf
    part_at = part_ptr + token * stride_pt + head * stride_ph
    part = tl.load(
        part_at + shares[:, None] * stride_ps + dims[None, :],
        mask=share_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * part, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


def merge_splits(partials: Partials, out: Tensor) -> None:
    """out ``[T, heads, head_dim]`` (mutated) = the shares of ``partials`` weighed by their
    softmax sums; zero for a row no share saw."""
    tokens, heads, splits, head_dim = partials.part.shape
    if not tokens:
        return
    _merge_splits[(tokens, heads)](
        partials.part, partials.lse, out, splits, *partials.part.stride()[:3],
        *partials.lse.stride()[:2], *out.stride(),
        SPLITS_P=max(MOST_SPLITS, triton.next_power_of_2(splits)),
        HEAD_DIM=head_dim, HEAD_P=max(16, triton.next_power_of_2(head_dim)),
    )  # fmt: skip

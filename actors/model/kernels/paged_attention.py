"""Paged attention: a Triton kernel over the block-major KV tensor (``kv_store.py`` writes it).

It reads the KV tensor in place, through per-piece block tables, never through a gathered
copy. ``k_cache`` and ``v_cache`` are one layer's views of the KV tensor
``[num_blocks, layers, 2, block_size, kv_heads, head_dim]`` (``kv[:, layer, 0]`` and
``kv[:, layer, 1]``: ``[num_blocks, block_size, kv_heads, head_dim]``, not contiguous); the
kernels take their strides, so no copy is made.

A step's pieces are described by :class:`StepTensors` (built by ``kernels/backend.py``, or
held as static buffers by a captured CUDA graph, ``actors/model/graphs.py``). One launch of
:func:`paged_attention` per layer serves every piece of the step: decode tokens and prefill
chunks alike (a "unified" varlen kernel, as vLLM's Triton attention is). Each program takes
up to ``block_q`` query tokens of one piece and one KV head, and stacks the query heads of
that KV head's group for those tokens as the rows of its tile (``block_q * group`` rows,
padded to a power of two of at least 16, what ``tl.dot`` needs): a decode token of a
grouped-query model still fills a tensor-core tile with its group's heads. Keys are visited
``tile_n`` at a time with an online softmax in float32 (float64 for float64 KV). A step
with ``splits`` > 1 runs that many programs per (piece, KV head), each over its share of the
keys, and merges them after (``split_keys.py``): a decode step of a few sequences.

Only this module imports Triton. Where no CUDA device is present, the kernels run in Triton's
interpreter on CPU tensors (``TRITON_INTERPRET``, set by ``actors/model/kernels/__init__.py``
before anything imports Triton, and again here in case this module is the first). The
interpreter's ``tl.dot`` misreads bfloat16 operands, so under it the
tiles are widened to float32 before each dot (``UPCAST``); on a GPU bfloat16 tiles go to the
tensor cores as they are.

Products (:func:`_matmul`): bfloat16 on the tensor cores; float32 in IEEE float32 (not TF32:
float32 is the exactness dtype, checked against the torch path); float64 as broadcast
products summed in float64, not ``tl.dot``, whose float64 support varies by GPU and Triton
version. That is slow, and ``model.attention=auto`` leaves float64 to the torch path.
"""

# Triton ships no type information: its decorator and the kernels' arguments (pointers,
# strides and sizes, typed by Triton at launch) are left untyped.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"
from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

import torch
from torch import Tensor

if not torch.cuda.is_available():  # see the module docstring: Triton's interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # after the variable above: Triton reads it at import
import triton.language as tl

from ringfence.actors.model.kernels.split_keys import (
    Partials,
    acc_dtype,
    merge_splits,
    share_of,
    store_share,
)

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
if INTERPRETED and type(tl.cdiv).__name__ != "InterpretedFunction":
    raise RuntimeError(
        "Triton was imported before TRITON_INTERPRET was set, so its own helpers cannot run "
        "in the interpreter: import ringfence.actors.model.kernels before building a model, "
        "or set TRITON_INTERPRET=1 in the environment"
    )
# Keys a program visits per loop iteration: 16 in the interpreter (a tile then spans few
# blocks of a test's tiny block size, so tile edges inside and across blocks get exercised).
TILE_N = 16 if INTERPRETED else 32
NO_WINDOW = 1 << 30  # a "window" wider than any position: every causal key is seen


class StepTensors(NamedTuple):
    """Where each piece of a step reads and writes, as the kernels take it (on the KV's device).

    Row ``i`` of ``tables`` and ``seq_lens`` is piece ``i``; its query tokens are rows
    ``query_start[i]..query_start[i+1]-1`` of the step's q and occupy positions
    ``seq_lens[i] - q_len .. seq_lens[i] - 1``. A piece with ``seq_lens`` 0 (the padding of a
    captured graph) reads no key and its output rows are zero.
    """

    slots: Tensor  # [T] int32: block * block_size + offset of each token's K/V; < 0: skip
    tables: Tensor  # [P, width] int32 block ids (past each piece's blocks: unread)
    query_start: Tensor  # [P + 1] int32 cumulative query tokens
    seq_lens: Tensor  # [P] int32: positions 0..seq_lens-1 of each piece are written
    program_piece: Tensor  # [programs] int32: the piece of each program along grid axis 0
    program_first: Tensor  # [programs] int32: its first query token within the piece
    block_q: int  # query tokens per program
    # Programs per (piece, KV head) along grid axis 2, each over its own share of the keys,
    # merged after (``split_keys.py``); 1: one program reads every key, and no merge.
    splits: int = 1
    split_keys: int = 0  # the fewest keys a split takes: a short context uses fewer splits


def tile_rows(group: int, longest: int) -> tuple[int, int]:
    """``(block_q, block_m)`` for a step whose longest piece has ``longest`` query tokens:
    a decode-only step takes one token per program (16 rows, or the group if larger), a step
    with chunks 64 rows' worth of tokens."""
    rows = max(16 if longest == 1 else 64, triton.next_power_of_2(group))
    return rows // group, rows


# The products of _matmul (see the module docstring).
TENSOR_CORES, IEEE_FLOAT32, SUMMED = 0, 1, 2


@triton.jit
def _matmul(a, b, ACC: tl.constexpr, PRODUCTS: tl.constexpr):
    """a [M, K] @ b [K, N] in ACC, as PRODUCTS says."""
    if PRODUCTS == 2:  # SUMMED
        c = tl.sum(a[:, :, None].to(ACC) * b[None, :, :].to(ACC), axis=1)
    elif PRODUCTS == 1:  # IEEE_FLOAT32
        c = tl.dot(a, b, input_precision="ieee", out_dtype=ACC)
    else:
        c = tl.dot(a, b, out_dtype=ACC)
    return c


@triton.jit
def _online_softmax(m_i, l_i, acc, scores, v, ACC: tl.constexpr, PRODUCTS: tl.constexpr):  # noqa: PLR0917
    """The running max, sum and output of each row after one more tile of keys: their
    ``scores`` (log2 units, -inf where unseen) and values ``v``."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # A row that has seen no key yet keeps m = -inf; shift by 0 so no -inf - -inf = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(scores - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _matmul(p.to(v.dtype), v, ACC, PRODUCTS)
    return m_new, l_i, acc


# A kernel takes every pointer, stride and size as an argument, and is one loop body. The
# split count and a share's least keys are not specialized on: one compile serves every count.
@triton.jit(do_not_specialize=["splits", "split_keys"])
def _paged_attention(  # noqa: PLR0917
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, query_start_ptr, seq_lens_ptr,
    program_piece_ptr, program_first_ptr, window, part_ptr, lse_ptr, splits, split_keys,
    stride_qt, stride_qh, stride_qd, stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd, stride_ot, stride_oh, stride_od, stride_table,
    stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_P: tl.constexpr,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
    SCALE: tl.constexpr, ACC: tl.constexpr, UPCAST: tl.constexpr, PRODUCTS: tl.constexpr,
    SPLIT: tl.constexpr,
):  # fmt: skip
    kv_head = tl.program_id(1)
    piece = tl.load(program_piece_ptr + tl.program_id(0))
    first = tl.load(program_first_ptr + tl.program_id(0))
    q_start = tl.load(query_start_ptr + piece)
    q_len = tl.load(query_start_ptr + piece + 1) - q_start
    end = tl.load(seq_lens_ptr + piece)
    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP  # within the piece
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (token < q_len)
    position = end - q_len + token
    dims = tl.arange(0, HEAD_P)
    dim_ok = dims < HEAD_DIM
    q_offsets = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(
        q_ptr + q_offsets + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(ACC)
    # Keys lo..hi-1 are all any row here may see; every one of them is written (hi <= end),
    # and nothing outside them is loaded: a free block or an unwritten slot may hold NaN.
    hi = tl.minimum(end - q_len + first + BLOCK_Q, end)
    lo = tl.maximum(end - q_len + first - window + 1, 0)
    if SPLIT:  # this program's share of them (split_keys.py)
        lo, hi = share_of(lo, hi, splits, split_keys, TILE)
    m_i = tl.full([BLOCK_M], float("-inf"), ACC)
    l_i = tl.full([BLOCK_M], 0.0, ACC)
    acc = tl.full([BLOCK_M, HEAD_P], 0.0, ACC)
    table_row = tables_ptr + piece.to(tl.int64) * stride_table
    for tile in range(lo // TILE, tl.cdiv(hi, TILE)):
        keys = tile * TILE + tl.arange(0, TILE)
        key_ok = (keys >= lo) & (keys < hi)
        block = tl.load(table_row + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = keys % BLOCK_SIZE
        loaded = key_ok[None, :] & dim_ok[:, None]
        k_offsets = block[None, :] * stride_kb + slot[None, :] * stride_ks + kv_head * stride_kh
        k = tl.load(k_ptr + k_offsets + dims[:, None] * stride_kd, mask=loaded, other=0.0)
        v_offsets = block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh
        v = tl.load(
            v_ptr + v_offsets + dims[None, :] * stride_vd,
            mask=key_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            k = k.to(ACC)
            v = v.to(ACC)
        scores = _matmul(q, k, ACC, PRODUCTS)
        seen = (
            key_ok[None, :]
            & (keys[None, :] <= position[:, None])
            & (keys[None, :] > position[:, None] - window)
        )
        scores = tl.where(seen, scores * SCALE, float("-inf"))
        m_i, l_i, acc = _online_softmax(m_i, l_i, acc, scores, v, ACC, PRODUCTS)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if SPLIT:  # the share's output and its log2-sum-exp, for the merge
        store_share(
            part_ptr, lse_ptr, out, m_i, l_i, q_start + token, head, row_ok, dims, dim_ok,
            stride_pt, stride_ph, stride_ps, stride_lt, stride_lh,
        )  # fmt: skip
    else:
        out_offsets = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh
        tl.store(
            out_ptr + out_offsets + dims[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


def _products(dtype: torch.dtype) -> int:
    if dtype == torch.float64:
        return SUMMED
    return IEEE_FLOAT32 if dtype == torch.float32 else TENSOR_CORES


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    out: Tensor,
    step: StepTensors,
    *,
    window: int | None,
    partials: Partials | None = None,
    tile: int = TILE_N,
) -> None:
    """Attend q ``[T, heads, head_dim]`` to each piece's keys through its block table, causal
    by position (and within ``window``), into out ``[T, heads, head_dim]`` (mutated; q's
    dtype). Reads only positions ``0..seq_lens-1`` of each piece's blocks. With
    ``step.splits`` > 1 each piece's keys are shared out among that many programs, whose
    outputs land in ``partials`` (made here if None; ``split_keys.py``) and are merged.
    ``tile``: keys a program visits per loop iteration, a power of two of at least 16 (what
    ``bench attention --tiles`` weighs)."""
    _, block_size, kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // kv_heads
    block_m = max(16, triton.next_power_of_2(step.block_q * group))
    dtype = k_cache.dtype
    acc: Any = tl.float64 if dtype == torch.float64 else tl.float32
    splits = step.splits
    if splits > 1 and partials is None:
        partials = Partials.empty(q, splits, acc_dtype(dtype))
    part, lse = (partials.part, partials.lse) if partials is not None and splits > 1 else (out, out)
    grid = (len(step.program_piece), kv_heads, splits)
    _paged_attention[grid](
        q, k_cache, v_cache, out, step.tables, step.query_start, step.seq_lens,
        step.program_piece, step.program_first, NO_WINDOW if window is None else window,
        part, lse, splits, step.split_keys,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), step.tables.stride(0),
        *part.stride()[:3], *lse.stride()[:2],
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_P=max(16, triton.next_power_of_2(head_dim)),
        GROUP=group, BLOCK_Q=step.block_q, BLOCK_M=block_m, TILE=tile,
        SCALE=head_dim**-0.5 * math.log2(math.e), ACC=acc, UPCAST=INTERPRETED,
        PRODUCTS=_products(dtype), SPLIT=splits > 1,
    )  # fmt: skip
    if splits > 1:
        assert partials is not None
        merge_splits(partials, out)

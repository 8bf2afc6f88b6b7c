"""The KV store: a step's new K and V written into their slots of the block-major KV tensor.

One program a token, every KV head of it: its K and V rows are read from the step's
projections (strided views of the qkv GEMM's output on the fused path) and written at its
slot (``block * block_size + offset``) of one layer's K and V views, whose strides the kernel
takes (``paged_attention.py`` says how the layer views lie). A token whose slot is negative
(a captured graph's padding row) writes nothing.
"""

# Triton's kernels take untyped pointers and its decorator is untyped.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import os

import torch
from torch import Tensor

if not torch.cuda.is_available():  # Triton's interpreter on the CPU (kernels/__init__.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton
import triton.language as tl


@triton.jit
def _store_kv(  # noqa: PLR0917
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_db, stride_ds, stride_dh, stride_dd,
    BLOCK_SIZE: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_P: tl.constexpr, HEAD_P: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    heads = tl.arange(0, HEADS_P)[:, None]
    dims = tl.arange(0, HEAD_P)[None, :]
    # The slot broadcast to the tile before the compare: Triton's interpreter refuses a
    # scalar condition combined into a tensor mask.
    written = tl.full([HEADS_P, HEAD_P], 0, tl.int64) + slot >= 0
    ok = (heads < KV_HEADS) & (dims < HEAD_DIM) & written
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims * stride_kd, mask=ok)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims * stride_vd, mask=ok)
    k_at = block * stride_cb + offset * stride_cs + heads * stride_ch + dims * stride_cd
    v_at = block * stride_db + offset * stride_ds + heads * stride_dh + dims * stride_dd
    tl.store(k_cache_ptr + k_at, k, mask=ok)
    tl.store(v_cache_ptr + v_at, v, mask=ok)


def store_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> None:
    """Write k, v ``[T, kv_heads, head_dim]`` into the caches' slots ``[T]`` (flat
    ``block * block_size + offset``); a token whose slot is negative writes nothing.
    Mutates ``k_cache`` and ``v_cache`` (layer views of the KV tensor) at those slots only."""
    if not len(slots):
        return
    _, block_size, kv_heads, head_dim = k_cache.shape
    _store_kv[(len(slots),)](
        k, v, k_cache, v_cache, slots, *k.stride(), *v.stride(), *k_cache.stride(),
        *v_cache.stride(), BLOCK_SIZE=block_size, KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        HEADS_P=triton.next_power_of_2(kv_heads), HEAD_P=triton.next_power_of_2(head_dim),
    )  # fmt: skip

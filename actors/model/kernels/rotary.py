"""The rotary embedding in one Triton kernel: a program a token, every head at once.

Written in torch ops (``Model._rope``), rotating queries or keys is five kernels on a GPU: the
negation, the concatenation of the halves, the two products and the sum. Twice a layer, so
about 160 small kernels of a 16-layer decode step. Here each token's heads are read once and
written once. :func:`rotate_qk` rotates a layer's queries and keys in one launch, in place in
the fused projection's output (``[T, (heads + 2 * kv_heads) * head_dim]``: q, k, v), as
vLLM's rotary does.

Each operation rounds to the model's dtype as torch's does (``x * cos`` and ``rotated * sin``
each rounded, then their sum), so in bfloat16 a GPU gives torch's values: a product of two
bfloat16 values is exact in float32, and torch adds two of them in float32 too. In float32 the
compiler may fuse a product and the sum into one rounding: the last bit may differ.
"""

# Triton ships no type information: its decorator and the kernels' arguments (pointers,
# strides and sizes, typed by Triton at launch) are left untyped.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ringfence.actors.model.decoder import Rope


@triton.jit
def _rotate_rows(  # noqa: PLR0917
    x_ptr, cos_ptr, sin_ptr, out_ptr, x_stride, out_stride, heads, second_heads, second_at,
    HALF: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr,
):  # fmt: skip
    # Axis 1 picks the group of heads: ``heads`` from column 0, or ``second_heads`` from
    # column ``second_at`` (the keys of a fused projection's row).
    token = tl.program_id(0).to(tl.int64)
    second = tl.program_id(1)
    count = tl.where(second == 0, heads, second_heads)
    column = tl.where(second == 0, 0, second_at).to(tl.int64)
    head = tl.arange(0, HEADS_P)[:, None]
    dim = tl.arange(0, HALF_P)[None, :]
    ok = (head < count) & (dim < HALF)
    at = column + head * 2 * HALF + dim
    x_row, out_row = x_ptr + token * x_stride + at, out_ptr + token * out_stride + at
    x1 = tl.load(x_row, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=ok, other=0.0).to(tl.float32)
    table = token * 2 * HALF + dim
    half_ok = dim < HALF
    cos1 = tl.load(cos_ptr + table, mask=half_ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + HALF, mask=half_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + table, mask=half_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + HALF, mask=half_ok, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # rotate_half(x) is (-x2, x1): out = x * cos + rotate_half(x) * sin, rounded as torch.
    a1 = (x1 * cos1).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    b1 = (-x2 * sin1).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    a2 = (x2 * cos2).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    b2 = (x1 * sin2).to(dtype, fp_downcast_rounding="rtne").to(tl.float32)
    # In place (out is x) is safe: a program alone reads and writes its token's heads, and
    # every store depends on both halves' loads.
    tl.store(out_row, (a1 + b1).to(dtype, fp_downcast_rounding="rtne"), mask=ok)
    tl.store(out_row + HALF, (a2 + b2).to(dtype, fp_downcast_rounding="rtne"), mask=ok)


def _refuse_float64(x: Tensor) -> None:
    if x.dtype == torch.float64:
        raise TypeError("the fused rotary works in float32: not for a float64 model")


def _launch(  # noqa: PLR0917
    x: Tensor, out: Tensor, rope: Rope, groups: int, heads: int, second: int, second_at: int,
    dim: int,
) -> None:  # fmt: skip
    tokens = x.shape[0]
    if tokens:
        half = dim // 2
        _rotate_rows[(tokens, groups)](
            x, rope.cos.contiguous(), rope.sin.contiguous(), out, x.stride(0), out.stride(0),
            heads, second, second_at, HALF=half, HALF_P=triton.next_power_of_2(half),
            HEADS_P=triton.next_power_of_2(max(heads, second)),
        )  # fmt: skip


def rotate(x: Tensor, rope: Rope) -> Tensor:
    """``x`` [T, heads, head_dim] rotated by ``rope`` (``Model.rope`` of its T positions),
    in ``x``'s dtype (float32, bfloat16 or float16)."""
    _refuse_float64(x)
    _, heads, dim = x.shape
    rows = x.contiguous()
    out = torch.empty_like(rows)
    _launch(rows, out, rope, 1, heads, 0, 0, dim)
    return out


def rotate_qk(qkv: Tensor, heads: int, kv_heads: int, rope: Rope) -> tuple[Tensor, Tensor]:
    """The queries and keys of a fused projection's rows ``qkv`` [T, (heads + 2 * kv_heads)
    * head_dim], rotated in place in one launch; returned as views of ``qkv``:
    ``[T, heads, head_dim]`` and ``[T, kv_heads, head_dim]``."""
    _refuse_float64(qkv)
    tokens, width = qkv.shape
    dim = width // (heads + 2 * kv_heads)
    if dim * (heads + 2 * kv_heads) != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} is not rows of {heads} + 2 x {kv_heads} heads")
    _launch(qkv, qkv, rope, 2, heads, kv_heads, heads * dim, dim)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    return q, qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)

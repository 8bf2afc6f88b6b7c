"""The rotary embedding in one Triton kernel: a program a token, every head at once.

Written in torch ops (``Model._rope``), rotating queries or keys is five kernels on a GPU: the
negation, the concatenation of the halves, the two products and the sum. Twice a layer, so
about 160 small kernels of a 16-layer decode step. Here each token's heads are read once and
written once.

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
    x_ptr, cos_ptr, sin_ptr, out_ptr, heads,
    HALF: tl.constexpr, HALF_P: tl.constexpr, HEADS_P: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.arange(0, HEADS_P)[:, None]
    dim = tl.arange(0, HALF_P)[None, :]
    ok = (head < heads) & (dim < HALF)
    row = token * heads * 2 * HALF + head * 2 * HALF
    x1 = tl.load(x_ptr + row + dim, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + row + HALF + dim, mask=ok, other=0.0).to(tl.float32)
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
    tl.store(out_ptr + row + dim, (a1 + b1).to(dtype, fp_downcast_rounding="rtne"), mask=ok)
    out2 = (a2 + b2).to(dtype, fp_downcast_rounding="rtne")
    tl.store(out_ptr + row + HALF + dim, out2, mask=ok)


def rotate(x: Tensor, rope: Rope) -> Tensor:
    """``x`` [T, heads, head_dim] rotated by ``rope`` (``Model.rope`` of its T positions),
    in ``x``'s dtype (float32, bfloat16 or float16)."""
    if x.dtype == torch.float64:
        raise TypeError("the fused rotary works in float32: not for a float64 model")
    tokens, heads, dim = x.shape
    rows = x.contiguous()
    out = torch.empty_like(rows)
    if rows.numel():
        half = dim // 2
        _rotate_rows[(tokens,)](
            rows, rope.cos.contiguous(), rope.sin.contiguous(), out, heads,
            HALF=half, HALF_P=triton.next_power_of_2(half), HEADS_P=triton.next_power_of_2(heads),
        )  # fmt: skip
    return out

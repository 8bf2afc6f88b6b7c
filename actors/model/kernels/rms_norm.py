"""RMSNorm in one Triton kernel: a program a row.

Written in torch ops (``Model._rms_norm``), a norm is eight kernels on a GPU: the cast up, the
square, the mean, the epsilon, the reciprocal root, the product, the cast down and the weight.
A decode step of a 16-layer model runs 33 norms, so about 260 kernels of a few microseconds
each, most of a small batch's step. Here each row is read once, its mean square summed in
float32, and written once.

The rounding is Hugging Face's (``LlamaRMSNorm``), which ``Model._rms_norm`` follows: the
normalized row is rounded to the model's dtype before the weight multiplies it, then the
product is rounded again. A product of two bfloat16 values is exact in float32, so that
second rounding is the one torch makes. Only the sum's order differs from torch's mean: the
last bits of the mean square. Not for float64 (the sum is in float32).
"""

# Triton's kernels take untyped pointers and its decorator is untyped.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm_rows(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):  # noqa: PLR0917
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    mean_square = tl.sum(x * x, axis=0) / n_cols
    dtype = out_ptr.dtype.element_ty
    normed = (x * tl.rsqrt(mean_square + eps)).to(dtype, fp_downcast_rounding="rtne")
    normed = normed.to(tl.float32)
    weight = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    out = (weight * normed).to(dtype, fp_downcast_rounding="rtne")
    tl.store(out_ptr + row * n_cols + cols, out, mask=inside)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x`` [..., n] normalized over its last dimension and scaled by ``weight`` [n], in
    ``x``'s dtype (float32, bfloat16 or float16), on the device ``x`` is on."""
    if x.dtype == torch.float64:
        raise TypeError("the fused RMSNorm sums in float32: not for a float64 model")
    n = x.shape[-1]
    rows = x.contiguous()
    out = torch.empty_like(rows)
    if rows.numel():
        _rms_norm_rows[(rows.numel() // n,)](
            rows, weight, out, n, eps, BLOCK=triton.next_power_of_2(n)
        )
    return out

"""RMSNorm in one Triton kernel, alone or after the residual add: a program a row.

Written in torch ops (``Model._rms_norm``), a norm is eight kernels on a GPU: the cast up, the
square, the mean, the epsilon, the reciprocal root, the product, the cast down and the weight.
A decode step of a 16-layer model runs 33 norms, so about 260 kernels of a few microseconds
each, most of a small batch's step. Here each row is read once, its mean square summed in
float32, and written once. The norm after a layer's attention follows the residual add
(``x + o_proj(attended)``): :func:`add_rms_norm` does both, reading each row once and
writing the sum and its norm.

The rounding is Hugging Face's (``LlamaRMSNorm``), which ``Model._rms_norm`` follows: the
normalized row is rounded to the model's dtype before the weight multiplies it, then the
product is rounded again. A product of two bfloat16 values is exact in float32, so that
second rounding is the one torch makes. The sum of the residual add is rounded to the dtype
before it is normalized, as torch's add is. Only the mean square's order differs from torch's
mean: its last bits. Not for float64 (the sum is in float32).
"""

# Triton's kernels take untyped pointers and its decorator is untyped.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _normed(x, w_ptr, cols, inside, n_cols, eps, dtype: tl.constexpr):  # noqa: PLR0917
    """Row x (float32, zero past n_cols) normalized and scaled, rounded as torch rounds."""
    mean_square = tl.sum(x * x, axis=0) / n_cols
    normed = (x * tl.rsqrt(mean_square + eps)).to(dtype, fp_downcast_rounding="rtne")
    weight = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    return (weight * normed.to(tl.float32)).to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def _rms_norm_rows(x_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):  # noqa: PLR0917
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    out = _normed(x, w_ptr, cols, inside, n_cols, eps, out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n_cols + cols, out, mask=inside)


@triton.jit
def _add_rms_norm_rows(  # noqa: PLR0917
    x_ptr, d_ptr, w_ptr, sum_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + row * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    total = (x + d).to(dtype, fp_downcast_rounding="rtne")
    tl.store(sum_ptr + row * n_cols + cols, total, mask=inside)
    out = _normed(total.to(tl.float32), w_ptr, cols, inside, n_cols, eps, dtype)
    tl.store(out_ptr + row * n_cols + cols, out, mask=inside)


def _refuse_float64(x: Tensor) -> None:
    if x.dtype == torch.float64:
        raise TypeError("the fused RMSNorm sums in float32: not for a float64 model")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x`` [..., n] normalized over its last dimension and scaled by ``weight`` [n], in
    ``x``'s dtype (float32, bfloat16 or float16), on the device ``x`` is on."""
    _refuse_float64(x)
    n = x.shape[-1]
    rows = x.contiguous()
    out = torch.empty_like(rows)
    if rows.numel():
        _rms_norm_rows[(rows.numel() // n,)](
            rows, weight, out, n, eps, BLOCK=triton.next_power_of_2(n)
        )
    return out


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(x + delta, rms_norm(x + delta))`` for rows [T, n] of one dtype, as torch's add then
    :func:`rms_norm` give them, in one kernel."""
    _refuse_float64(x)
    if delta.shape != x.shape or delta.dtype != x.dtype:
        raise ValueError(f"delta {tuple(delta.shape)} {delta.dtype} is not x's {tuple(x.shape)}")
    n = x.shape[-1]
    rows, deltas = x.contiguous(), delta.contiguous()
    total, out = torch.empty_like(rows), torch.empty_like(rows)
    if rows.numel():
        _add_rms_norm_rows[(rows.numel() // n,)](
            rows, deltas, weight, total, out, n, eps, BLOCK=triton.next_power_of_2(n)
        )
    return total, out

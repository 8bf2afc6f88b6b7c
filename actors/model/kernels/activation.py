"""The MLP's gated activation in one Triton kernel: ``silu(gate) * up`` of the fused gate-up
projection's rows.

Written in torch ops (``Model.finish_layer``), it is two kernels on a GPU (the SiLU, then the
product), and the gate and up projections two GEMMs. With the projections' weights stacked
(``Model.use_kernels``), one GEMM gives each token's row ``[gate | up]`` and this kernel reads
it once and writes the product. SiLU is computed as torch's GPU kernel computes it,
``g / (1 + exp(-g))`` in float32, and rounded to the model's dtype before the product, which is
rounded again: torch's two roundings. Triton's ``exp`` may differ from the CUDA library's in
the last bit of a float32, which rounding to bfloat16 almost always hides.
"""

# Triton's kernels take untyped pointers and its decorator is untyped.
# mypy: disable-error-code="untyped-decorator,no-untyped-def"

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024  # columns a program


@triton.jit
def _silu_mul_rows(  # noqa: PLR0917
    gate_up_ptr, out_ptr, width, in_stride, out_stride, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < width
    source = gate_up_ptr + row * in_stride + cols
    gate = tl.load(source, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(source + width, mask=inside, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype, fp_downcast_rounding="rtne")
    out = (silu.to(tl.float32) * up).to(dtype, fp_downcast_rounding="rtne")
    tl.store(out_ptr + row * out_stride + cols, out, mask=inside)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` [T, n] of rows ``gate_up`` [T, 2n] (the gate's n columns, then the
    up projection's), in their dtype (float32, bfloat16 or float16)."""
    if gate_up.dtype == torch.float64:
        raise TypeError("the fused SiLU works in float32: not for a float64 model")
    tokens, double = gate_up.shape
    if double % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up {tuple(gate_up.shape)} is not rows of [gate | up]")
    width = double // 2
    out = torch.empty(tokens, width, dtype=gate_up.dtype, device=gate_up.device)
    if tokens and width:
        block = min(BLOCK, triton.next_power_of_2(width))
        _silu_mul_rows[(tokens, triton.cdiv(width, block))](
            gate_up, out, width, gate_up.stride(0), out.stride(0), BLOCK=block
        )
    return out

"""The fused RMSNorm (``actors/model/kernels/rms_norm.py``) against the model's own norm in
torch ops, in Triton's interpreter here and compiled for a Hopper GPU; a model that uses it
gives the logits it gives without it."""

from __future__ import annotations

import pytest
import torch
from hopper import compiled_for_hopper

from ringfence.actors.model.decoder import PRESETS, Model
from ringfence.actors.model.kernels import triton_available
from ringfence.actors.model.paged import PagedExecutor, make_kv_cache

pytestmark = pytest.mark.skipif(
    not triton_available(), reason="Triton is not installed (the test extra installs it)"
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def torch_norm(model: Model, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The model's norm in torch ops (Hugging Face's rounding)."""
    kernel, model.norm_kernel = model.norm_kernel, None
    try:
        return model._rms_norm(x, weight)
    finally:
        model.norm_kernel = kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 256), (5, 4, 64), (3, 80), (1, 2048)])
def test_the_kernel_normalizes_each_row_as_the_models_torch_ops(dtype, shape) -> None:
    from ringfence.actors.model.kernels.rms_norm import rms_norm

    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        pytest.skip(
            "Triton's interpreter rounds float32 to bfloat16 toward zero; a GPU rounds to "
            "nearest, as torch does (device-check runs this case)"
        )

    gen = torch.Generator().manual_seed(sum(shape))
    model = Model(PRESETS["tiny"], torch.float32, 0)
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(dtype).to(DEVICE)
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype).to(DEVICE)
    ours, theirs = rms_norm(x, weight, 1e-6), torch_norm(model.to(DEVICE), x, weight)
    assert ours.dtype == dtype and ours.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    else:  # only the mean square's last bits differ: now and then one step of the dtype
        bits = 7 if dtype == torch.bfloat16 else 10
        step = torch.exp2(torch.floor(torch.log2(theirs.float().abs())) - bits)
        assert bool(((ours.float() - theirs.float()).abs() <= step).all())
        assert (ours == theirs).float().mean().item() > 0.95


def test_an_empty_step_and_a_float64_model_are_handled() -> None:
    from ringfence.actors.model.kernels.rms_norm import rms_norm

    empty = torch.empty(0, 64, device=DEVICE)
    assert rms_norm(empty, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    with pytest.raises(TypeError, match="float64"):
        rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6)


def test_a_model_with_the_fused_norm_gives_its_logits_without_it() -> None:
    from ringfence.actors.model.kernels.rms_norm import rms_norm

    model = Model(PRESETS["tiny"], torch.float32, 0).to(DEVICE)
    tokens = torch.tensor([3, 17, 42, 99, 5, 250, 7], device=DEVICE)
    plain = model.forward_contiguous(tokens)
    model.norm_kernel = rms_norm
    fused = model.forward_contiguous(tokens)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


def test_the_executor_fuses_the_norm_only_with_triton_on_a_gpu() -> None:
    for attention in ("torch", "triton"):
        model = Model(PRESETS["tiny"], torch.float32, 0).to(DEVICE)
        kv = make_kv_cache(model.config, 8, 4, torch.float32, DEVICE)
        PagedExecutor(model, kv, attention=attention)
        fused = attention == "triton" and DEVICE.type == "cuda"
        assert (model.norm_kernel is not None) == fused, attention


COMPILE_FOR_SM90 = r"""
import os
os.environ["TRITON_INTERPRET"] = "0"
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ringfence.actors.model.kernels import rms_norm as rn

for dtype in ("bf16", "fp32"):
    for width in (128, 2048):
        signature = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}",
                     "n_cols": "i32", "eps": "fp32", "BLOCK": "constexpr"}
        names = list(rn._rms_norm_rows.arg_names)
        source = ASTSource(fn=rn._rms_norm_rows, signature=signature,
                           constexprs={(names.index("BLOCK"),): width})
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        print("rms_norm", dtype, width, len(compiled.asm["cubin"]) > 0)
"""


def test_the_kernel_compiles_for_a_hopper_gpu_even_without_one() -> None:
    lines = compiled_for_hopper(COMPILE_FOR_SM90)
    assert len(lines) == 4 and all(line.endswith("True") for line in lines), lines

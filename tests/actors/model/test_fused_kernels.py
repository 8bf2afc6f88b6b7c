"""The fused kernels (``actors/model/kernels/rms_norm.py``, ``rotary.py``, ``activation.py``)
against the model's own torch ops, in Triton's interpreter here and compiled for a Hopper GPU;
a model that uses them, with its projections stacked, gives the logits it gives without them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hopper import compiled_for_hopper

from ringfence.actors.model.decoder import PRESETS, Model, Rope
from ringfence.actors.model.kernels import fused, triton_available
from ringfence.actors.model.paged import PagedExecutor, make_kv_cache

pytestmark = pytest.mark.skipif(
    not triton_available(), reason="Triton is not installed (the test extra installs it)"
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def torch_norm(model: Model, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The model's norm in torch ops (Hugging Face's rounding)."""
    assert model.kernels is None
    return model._rms_norm(x, weight)


def close_in_steps(ours: torch.Tensor, theirs: torch.Tensor, dtype: torch.dtype) -> None:
    """Equal up to the last bits of a float32 sum: now and then one step of the dtype."""
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
        return
    bits = 7 if dtype == torch.bfloat16 else 10
    step = torch.exp2(torch.floor(torch.log2(theirs.float().abs())) - bits)
    assert bool(((ours.float() - theirs.float()).abs() <= step).all())
    assert (ours == theirs).float().mean().item() > 0.95


def skip_bfloat16_in_the_interpreter(dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and DEVICE.type != "cuda":
        pytest.skip(
            "Triton's interpreter rounds float32 to bfloat16 toward zero; a GPU rounds to "
            "nearest, as torch does (device-check runs this case)"
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 256), (5, 4, 64), (3, 80), (1, 2048)])
def test_the_kernel_normalizes_each_row_as_the_models_torch_ops(dtype, shape) -> None:
    from ringfence.actors.model.kernels.rms_norm import rms_norm

    skip_bfloat16_in_the_interpreter(dtype)
    gen = torch.Generator().manual_seed(sum(shape))
    model = Model(PRESETS["tiny"], torch.float32, 0)
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(dtype).to(DEVICE)
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype).to(DEVICE)
    ours, theirs = rms_norm(x, weight, 1e-6), torch_norm(model.to(DEVICE), x, weight)
    assert ours.dtype == dtype and ours.shape == x.shape
    close_in_steps(ours, theirs, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "heads", "head_dim"), [(5, 4, 64), (3, 3, 80), (1, 32, 64)])
def test_the_kernel_rotates_each_head_as_the_models_torch_ops(dtype, tokens, heads, head_dim):
    from ringfence.actors.model.kernels.rotary import rotate

    skip_bfloat16_in_the_interpreter(dtype)
    shape = dataclasses.replace(PRESETS["tiny"], head_dim=head_dim, max_position=64)
    model = Model(shape, torch.float32, 0).to(DEVICE)
    gen = torch.Generator().manual_seed(tokens * heads)
    x = torch.randn(tokens, heads, head_dim, generator=gen).to(dtype).to(DEVICE)
    positions = torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE)
    tables = model.rope(positions)  # the tables in the model's dtype, as a model of it has
    rope = Rope(tables.cos.to(dtype), tables.sin.to(dtype))
    ours, theirs = rotate(x, rope), model._rope(x, rope)
    assert ours.dtype == dtype and ours.shape == x.shape
    close_in_steps(ours, theirs, dtype)


def test_an_empty_step_and_a_float64_model_are_handled() -> None:
    from ringfence.actors.model.kernels.rms_norm import rms_norm
    from ringfence.actors.model.kernels.rotary import rotate

    empty = torch.empty(0, 64, device=DEVICE)
    assert rms_norm(empty, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    with pytest.raises(TypeError, match="float64"):
        rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-6)
    model = Model(PRESETS["tiny"], torch.float32, 0).to(DEVICE)
    rope = model.rope(torch.empty(0, dtype=torch.long, device=DEVICE))
    heads, dim = model.config.heads, model.config.head_dim
    assert rotate(torch.empty(0, heads, dim, device=DEVICE), rope).shape == (0, heads, dim)
    with pytest.raises(TypeError, match="float64"):
        rotate(torch.ones(1, heads, dim, dtype=torch.float64), rope)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 256), (1, 2048), (3, 80)])
def test_the_add_and_norm_kernel_gives_torchs_sum_and_its_norm(dtype, shape) -> None:
    from ringfence.actors.model.kernels.rms_norm import add_rms_norm

    skip_bfloat16_in_the_interpreter(dtype)
    gen = torch.Generator().manual_seed(sum(shape) + 1)
    model = Model(PRESETS["tiny"], torch.float32, 0).to(DEVICE)
    x, delta = ((torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE) for _ in range(2))
    weight = (torch.rand(shape[-1], generator=gen) + 0.5).to(dtype).to(DEVICE)
    total, normed = add_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(total, x + delta)  # one rounding of an exact float32 sum, as torch's
    close_in_steps(normed, torch_norm(model, x + delta, weight), dtype)
    with pytest.raises(ValueError, match="delta"):
        add_rms_norm(x, delta[..., 1:], weight, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "width"), [(5, 96), (2, 1500), (1, 8192)])
def test_the_activation_kernel_gives_silu_of_the_gate_times_up(dtype, tokens, width) -> None:
    from ringfence.actors.model.kernels.activation import silu_mul

    skip_bfloat16_in_the_interpreter(dtype)
    gen = torch.Generator().manual_seed(tokens + width)
    gate_up = (torch.randn(tokens, 2 * width, generator=gen) * 4).to(dtype).to(DEVICE)
    gate, up = gate_up[:, :width], gate_up[:, width:]
    ours = silu_mul(gate_up)
    assert ours.shape == (tokens, width) and ours.dtype == dtype
    close_in_steps(ours, torch.nn.functional.silu(gate) * up, dtype)
    # The gate and up halves are not exchangeable: a kernel that read them swapped fails.
    assert not torch.allclose(ours, torch.nn.functional.silu(up) * gate)
    with pytest.raises(ValueError, match="gate_up"):
        silu_mul(gate_up[:, 1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (3, 3), (32, 8)])
def test_q_and_k_rotate_in_place_in_one_launch_as_each_alone(dtype, heads, kv_heads) -> None:
    from ringfence.actors.model.kernels.rotary import rotate_qk

    skip_bfloat16_in_the_interpreter(dtype)
    dim, tokens = 64, 5
    shape = dataclasses.replace(PRESETS["tiny"], head_dim=dim, max_position=64)
    model = Model(shape, torch.float32, 0).to(DEVICE)
    gen = torch.Generator().manual_seed(heads * kv_heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype).to(DEVICE)
    tables = model.rope(torch.randint(0, 64, (tokens,), generator=gen).to(DEVICE))
    rope = Rope(tables.cos.to(dtype), tables.sin.to(dtype))
    before = qkv.clone()
    q_rows, k_rows = before[:, : heads * dim], before[:, heads * dim : (heads + kv_heads) * dim]
    q, k = rotate_qk(qkv, heads, kv_heads, rope)
    assert q.shape == (tokens, heads, dim) and k.shape == (tokens, kv_heads, dim)
    assert q.data_ptr() == qkv.data_ptr()  # views of the rotated rows
    close_in_steps(q, model._rope(q_rows.reshape(tokens, heads, dim), rope), dtype)
    close_in_steps(k, model._rope(k_rows.reshape(tokens, kv_heads, dim), rope), dtype)
    v = (heads + kv_heads) * dim
    assert torch.equal(qkv[:, v:], before[:, v:])  # the values are left as they were


FLAGGED = dataclasses.replace(PRESETS["tiny"], qkv_bias=True, o_bias=True, qk_norm=True)


@pytest.mark.parametrize("shape", [PRESETS["tiny"], FLAGGED], ids=["llama", "biases-qk-norm"])
def test_a_model_with_the_fused_kernels_gives_its_logits_without_them(shape) -> None:
    model = Model(shape, torch.float32, 0)
    gen = torch.Generator().manual_seed(5)
    for name, p in model.named_parameters():
        if name.endswith("bias"):  # zero as drawn: random here, so their stacking shows
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    model = model.to(DEVICE)
    tokens = torch.tensor([3, 17, 42, 99, 5, 250, 7], device=DEVICE)
    plain = model.forward_contiguous(tokens)
    weights = {name: p.clone() for name, p in model.named_parameters()}
    model.use_kernels(fused())
    assert model.stacked is not None and len(model.stacked) == model.config.layers
    # The parameters keep their names and values, as views of the stacked weights.
    q_proj = model.decoder_layers[0].self_attn.q_proj.weight
    assert q_proj.data_ptr() == model.stacked[0].qkv.data_ptr()
    for name, p in model.named_parameters():
        assert torch.equal(p, weights[name]), name
    with_kernels = model.forward_contiguous(tokens)
    torch.testing.assert_close(with_kernels, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(with_kernels.argmax(-1), plain.argmax(-1))
    model.use_kernels(None)  # the torch ops again, on the stacked weights' views
    torch.testing.assert_close(model.forward_contiguous(tokens), plain, rtol=1e-5, atol=1e-5)


def test_the_executor_fuses_only_with_triton_on_a_gpu() -> None:
    for attention in ("torch", "triton"):
        model = Model(PRESETS["tiny"], torch.float32, 0).to(DEVICE)
        kv = make_kv_cache(model.config, 8, 4, torch.float32, DEVICE)
        PagedExecutor(model, kv, attention=attention)
        with_kernels = attention == "triton" and DEVICE.type == "cuda"
        assert (model.kernels is not None) == with_kernels, attention
        assert (model.stacked is not None) == with_kernels, attention


COMPILE_FOR_SM90 = r"""
import os
os.environ["TRITON_INTERPRET"] = "0"
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ringfence.actors.model.kernels import activation as ac
from ringfence.actors.model.kernels import rms_norm as rn
from ringfence.actors.model.kernels import rotary as ro

def build(kernel, signature, constants):
    names = list(kernel.arg_names)
    signature |= {name: "constexpr" for name in constants}
    constexprs = {(names.index(name),): value for name, value in constants.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32))

for dtype in ("bf16", "fp32"):
    for width in (128, 2048):
        rows = {"n_cols": "i32", "eps": "fp32"}
        signature = {"x_ptr": f"*{dtype}", "w_ptr": f"*{dtype}", "out_ptr": f"*{dtype}"} | rows
        compiled = build(rn._rms_norm_rows, signature, {"BLOCK": width})
        print("rms_norm", dtype, width, len(compiled.asm["cubin"]) > 0)
        pointers = ("x_ptr", "d_ptr", "w_ptr", "sum_ptr", "out_ptr")
        signature = {name: f"*{dtype}" for name in pointers}
        compiled = build(rn._add_rms_norm_rows, signature | rows, {"BLOCK": width})
        print("add_rms_norm", dtype, width, len(compiled.asm["cubin"]) > 0)
    for heads in (8, 32):
        signature = {"x_ptr": f"*{dtype}", "cos_ptr": f"*{dtype}", "sin_ptr": f"*{dtype}",
                     "out_ptr": f"*{dtype}", "x_stride": "i32", "out_stride": "i32",
                     "heads": "i32", "second_heads": "i32", "second_at": "i32"}
        compiled = build(ro._rotate_rows, signature, {"HALF": 32, "HALF_P": 32, "HEADS_P": heads})
        print("rotary", dtype, heads, len(compiled.asm["cubin"]) > 0)
    signature = {"gate_up_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "width": "i32",
                 "in_stride": "i32", "out_stride": "i32"}
    compiled = build(ac._silu_mul_rows, signature, {"BLOCK": 1024})
    print("silu_mul", dtype, len(compiled.asm["cubin"]) > 0)
"""


def test_the_kernels_compile_for_a_hopper_gpu_even_without_one() -> None:
    lines = compiled_for_hopper(COMPILE_FOR_SM90)
    assert len(lines) == 14 and all(line.endswith("True") for line in lines), lines

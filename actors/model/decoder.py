"""A decoder of the supported families in plain torch, with seeded random weights.

Parameter names are those of the Hugging Face state dicts (``model.embed_tokens.weight``,
``model.layers.N.self_attn.q_proj.weight`` and ``.bias`` where the shape has
``qkv_bias``, ``model.layers.N.self_attn.q_norm.weight`` where it has ``qk_norm``, ...,
``model.layers.N.mlp.gate_proj.weight``, ``model.layers.N.input_layernorm.weight``,
``model.norm.weight``, ``lm_head.weight``; ``shape.expected_tensors`` lists them), and the
rotary embedding uses their ``rotate_half`` convention, so a checkpoint loader can map
tensors 1:1. The code reads the shape's flags, never the architecture's name
(``actors/model/families.py`` says which family sets which flag). The modules are
only parameter containers: the forward pass is written out with ``torch.nn.functional``
so that the paged executor (``actors/model/paged.py``) runs the very same per-layer code and
differs only in where attention reads its keys and values.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ringfence.actors.model.parallel import SINGLE, WHOLE, Group, Shard, local_shape, take_shard
from ringfence.actors.model.shape import PRESETS, ModelShape, expected_tensors

__all__ = [
    "DTYPES", "PRESETS", "Kernels", "Model", "ModelShape", "Stacked", "inverse_frequencies",
    "kv_block_bytes", "window_mask",
]  # fmt: skip

DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def kv_block_bytes(config: ModelShape, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block: every layer's K and V for ``block_size`` tokens."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return config.layers * 2 * block_size * config.kv_heads * config.head_dim * itemsize


def inverse_frequencies(config: ModelShape) -> Tensor:
    """The rotary inverse frequencies [head_dim / 2] in float64, scaled as transformers does.

    ``linear`` divides every frequency by the factor; ``llama3`` divides those of
    wavelengths above original/low_freq_factor, keeps those below original/high_freq_factor,
    and interpolates between (transformers' ``_compute_llama3_parameters``).
    """
    dim = config.head_dim
    inv_freq = config.rope_theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    original, factor = scaling.original_max_position, scaling.factor
    low_freq_wavelen = original / scaling.low_freq_factor
    high_freq_wavelen = original / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def window_mask(queries: Tensor, keys: Tensor, window: int | None) -> Tensor:
    """Which keys each query sees [len(queries), len(keys)]: key j at query i when j <= i
    and, under a sliding window, i - window < j (transformers' sliding_window_overlay)."""
    seen = keys.unsqueeze(0) <= queries.unsqueeze(1)
    if window is not None:
        seen &= keys.unsqueeze(0) > queries.unsqueeze(1) - window
    return seen


class QKV(NamedTuple):
    """One layer's attention inputs for T tokens, rotary already applied."""

    q: Tensor  # [T, heads, head_dim]
    k: Tensor  # [T, kv_heads, head_dim]
    v: Tensor  # [T, kv_heads, head_dim]


class Rope(NamedTuple):
    """The rotary cos and sin of a step's positions, [T, 1, head_dim] each: gathered once a
    step, not once a layer (on a GPU each gather is a kernel: 64 a step for 16 layers)."""

    cos: Tensor
    sin: Tensor


class Kernels(NamedTuple):
    """Fused kernels of the forward (``actors/model/kernels/``), which a paged executor gives
    its model where the step runs Triton on a GPU (:meth:`Model.use_kernels`). Each does the
    work of a few torch ops in one launch and rounds as they round."""

    norm: Callable[[Tensor, Tensor, float], Tensor]  # rms_norm(x, weight, eps)
    add_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]  # x + d, its norm
    rotate: Callable[[Tensor, Rope], Tensor]  # x [T, heads, head_dim] rotated
    rotate_qk: Callable[[Tensor, int, int, Rope], tuple[Tensor, Tensor]]  # in a qkv row, in place
    silu_mul: Callable[[Tensor], Tensor]  # silu(gate) * up of [gate | up] rows


class Residual(NamedTuple):
    """The residual stream after a layer, its MLP's output not added yet: the next layer's
    input norm adds it (:meth:`Model.layer_input`), on the fused path in the same kernel
    as the norm (a launch fewer a layer); after the last layer, :meth:`whole`."""

    x: Tensor  # the stream after the layer's attention
    pending: Tensor  # the layer's MLP output, to add to it

    def whole(self) -> Tensor:
        return self.x + self.pending


class Stacked(NamedTuple):
    """One layer's projections that read the same input, as rows of one weight each, for one
    GEMM instead of three and two: the layer's q_proj, k_proj and v_proj weights (and biases)
    are views of ``qkv`` and ``qkv_bias``, gate_proj's and up_proj's of ``gate_up``."""

    qkv: Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: Tensor | None
    gate_up: Tensor  # [2 * intermediate, hidden]


def _stack(modules: list[nn.Module], name: str) -> Tensor | None:
    """The modules' parameter ``name`` as rows of one new tensor, each module's parameter
    then a view of its rows (the old tensors are freed); None where they have none."""
    parts: list[Tensor | None] = [getattr(m, name) for m in modules]
    if any(part is None for part in parts):
        return None
    whole = torch.cat([part.data for part in parts if part is not None])
    start = 0
    for module, part in zip(modules, parts, strict=True):
        assert part is not None
        rows = whole[start : start + part.shape[0]]
        setattr(module, name, nn.Parameter(rows, requires_grad=False))
        start += part.shape[0]
    return whole


class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width))


class Attention(nn.Module):
    def __init__(self, c: ModelShape) -> None:
        super().__init__()
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=c.o_bias)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim)
            self.k_norm = RMSNorm(c.head_dim)


class MLP(nn.Module):
    def __init__(self, c: ModelShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.intermediate, bias=False)
        self.down_proj = nn.Linear(c.intermediate, c.hidden, bias=False)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelShape) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden)
        self.post_attention_layernorm = RMSNorm(c.hidden)


class Body(nn.Module):
    def __init__(self, c: ModelShape) -> None:
        super().__init__()
        # Built on the meta device and overwritten: an Embedding given its tensor skips its
        # random init, whose meta kernel imports torch._dynamo (2-3 s of a Worker's start).
        self.embed_tokens = nn.Embedding(
            c.vocab_size, c.hidden, _weight=torch.empty(c.vocab_size, c.hidden)
        )
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden)


class Model(nn.Module):
    """The decoder: parameters, the per-layer pieces, and the contiguous reference forward.

    Immutable after construction (no grad, inference only); safe to share between
    threads that only read it. ``forward_contiguous`` keeps no state between calls.

    Under tensor parallelism (``shard.size`` > 1, ``actors/model/parallel.py``) it holds
    one rank's shard: ``config`` stays the whole model's shape, ``local`` is this rank's
    (its heads, KV heads and MLP width), and each layer's row-parallel outputs are summed
    over the ranks by ``group``. Every rank's random weights are slices of the same whole
    tensors, drawn as a single rank draws them, so any ``tp_size`` computes the same model.
    ``seed`` None leaves the parameters unset, for a loader that overwrites every one.
    """

    rope_cos: Tensor  # [max_position, head_dim] rotary table; a buffer, not in the state dict
    rope_sin: Tensor

    def __init__(
        self,
        config: ModelShape,
        dtype: torch.dtype,
        seed: int | None,
        *,
        shard: Shard = WHOLE,
        group: Group | None = None,
    ) -> None:
        super().__init__()
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
        if group is not None and group.shard != shard:
            raise ValueError(f"the group is of {group.shard}, the model of {shard}")
        self.config = config
        self.local = local_shape(config, shard.size)
        self.shard = shard
        # The fused kernels and stacked projections, where the paged executor runs Triton on
        # a GPU (use_kernels; paged.py).
        self.kernels: Kernels | None = None
        self.stacked: list[Stacked] | None = None
        self.group = group or (SINGLE if shard.size == 1 else Group(shard, None))
        self.dtype = dtype
        with torch.device("meta"):
            self.model = Body(self.local)
            self.lm_head = nn.Linear(config.hidden, config.vocab_size, bias=False)
        self.decoder_layers: list[DecoderLayer] = list(self.model.layers)  # type: ignore[arg-type]
        # As to_empty(device="cpu"), without torch.empty_like of meta tensors: its reference
        # kernel imports sympy (most of a second of a Worker's start). No buffer exists yet.
        for module in self.modules():
            for name, param in module.named_parameters(recurse=False):
                empty = torch.empty(param.shape, dtype=param.dtype, device="cpu")
                setattr(module, name, nn.Parameter(empty, requires_grad=param.requires_grad))
        if seed is not None:
            self._init_weights(seed)
        if config.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.to(dtype)
        self.requires_grad_(False)
        # Rotary tables in float64, then cast: both execution paths index the same table.
        inv_freq = inverse_frequencies(config)
        angles = torch.outer(torch.arange(config.max_position, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("rope_cos", angles.cos().to(dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin().to(dtype), persistent=False)

    @classmethod
    def from_preset(
        cls,
        name: str,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        *,
        shard: Shard = WHOLE,
        group: Group | None = None,
    ) -> Model:
        """A preset with random weights that depend only on ``seed`` (the same in every
        dtype), or ``shard``'s slices of them."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
        return cls(PRESETS[name], dtype, seed, shard=shard, group=group)

    def _init_weights(self, seed: int) -> None:
        # Drawn in float32 in a fixed order from a private generator: deterministic
        # across runs and dtypes, and the global RNG is left alone. Biases start at zero.
        # Each tensor is drawn whole (the whole model's shape) and this rank keeps its slice.
        gen = torch.Generator().manual_seed(seed)
        whole = expected_tensors(self.config)
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                param.data.fill_(1.0)
            elif name.endswith(".bias"):
                param.data.zero_()
            else:
                shape = whole[name]
                fan_in = self.config.hidden if "embed_tokens" in name else shape[1]
                std = fan_in**-0.5
                drawn = torch.randn(shape, generator=gen) * std
                param.data.copy_(take_shard(name, drawn, self.shard))

    def use_kernels(self, kernels: Kernels | None) -> None:
        """Run the forward with ``kernels``, or with torch's ops (None). The first time, each
        layer's projections are stacked (:class:`Stacked`): the parameters keep their names
        and values as views of the stacked weights, so nothing else sees a change and no
        memory is added. Call it once the model is on its device (``to`` would copy each view
        apart). The numbers are the torch ops' up to a GEMM's rounding of a wider output."""
        self.kernels = kernels
        if kernels is None or self.stacked is not None:
            return
        stacked = []
        for layer in self.decoder_layers:
            att, mlp = layer.self_attn, layer.mlp
            projections: list[nn.Module] = [att.q_proj, att.k_proj, att.v_proj]
            qkv = _stack(projections, "weight")
            gate_up = _stack([mlp.gate_proj, mlp.up_proj], "weight")
            assert qkv is not None and gate_up is not None
            stacked.append(Stacked(qkv, _stack(projections, "bias"), gate_up))
        self.stacked = stacked

    def _rms_norm(self, x: Tensor, weight: Tensor) -> Tensor:
        if self.kernels is not None:  # one kernel on the GPU (kernels/rms_norm.py)
            return self.kernels.norm(x, weight, self.config.norm_eps)
        # Like Hugging Face: normalize in at least float32, scale in the model dtype.
        h = x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.config.norm_eps)
        return weight * h.to(x.dtype)

    def rope(self, positions: Tensor) -> Rope:
        """The rotary tables at ``positions`` [T], for every layer's :meth:`attention_inputs`."""
        return Rope(self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1))

    def _rope(self, x: Tensor, rope: Rope) -> Tensor:
        if self.kernels is not None:  # one kernel on the GPU (kernels/rotary.py)
            return self.kernels.rotate(x, rope)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * rope.cos + rotated * rope.sin

    def embed(self, token_ids: Tensor, *, checked: bool = False) -> Tensor:
        """Hidden states [T, hidden] of token ids [T]; ValueError for an id outside the
        vocabulary, unless the caller ``checked`` them on the host already (the check reads
        the ids back: on a GPU it waits for the device)."""
        if (
            not checked
            and token_ids.numel()
            and not (int(token_ids.min()) >= 0 and int(token_ids.max()) < self.config.vocab_size)
        ):
            raise ValueError(f"token ids must lie in 0..{self.config.vocab_size - 1}")
        return F.embedding(token_ids, self.model.embed_tokens.weight)

    def layer_input(self, index: int, stream: Tensor | Residual) -> tuple[Tensor, Tensor]:
        """The residual stream entering layer ``index`` (the layer before's output added, as a
        :class:`Residual` leaves it) and its input norm, ``(x, h)``: on the fused path the
        add and the norm are one kernel."""
        weight = self.decoder_layers[index].input_layernorm.weight
        if isinstance(stream, Residual):
            if self.kernels is not None:
                return self.kernels.add_norm(stream.x, stream.pending, weight, self.config.norm_eps)
            stream = stream.whole()
        return stream, self._rms_norm(stream, weight)

    def attention_inputs(self, index: int, h: Tensor, rope: Rope) -> QKV:
        """Layer ``index``'s queries, keys and values of its normed input h [T, hidden]
        (:meth:`layer_input`), rotated by ``rope`` (:meth:`rope` of their positions)."""
        c = self.local
        layer = self.decoder_layers[index]
        att = layer.self_attn
        kv_width = c.kv_heads * c.head_dim
        if self.kernels is not None and self.stacked is not None:
            # One GEMM for q, k and v; without q/k norms, one launch rotating q and k in
            # place (kernels/rotary.py).
            stacked = self.stacked[index]
            qkv = F.linear(h, stacked.qkv, stacked.qkv_bias)
            v = qkv[:, qkv.shape[1] - kv_width :].view(-1, c.kv_heads, c.head_dim)
            if not c.qk_norm:
                return QKV(*self.kernels.rotate_qk(qkv, c.heads, c.kv_heads, rope), v)
            q = qkv[:, : c.heads * c.head_dim].view(-1, c.heads, c.head_dim)
            k = qkv[:, c.heads * c.head_dim : qkv.shape[1] - kv_width]
            k = k.view(-1, c.kv_heads, c.head_dim)
        else:
            q = F.linear(h, att.q_proj.weight, att.q_proj.bias).view(-1, c.heads, c.head_dim)
            k = F.linear(h, att.k_proj.weight, att.k_proj.bias).view(-1, c.kv_heads, c.head_dim)
            v = F.linear(h, att.v_proj.weight, att.v_proj.bias).view(-1, c.kv_heads, c.head_dim)
        if c.qk_norm:  # per head, over head_dim, before rotary
            q = self._rms_norm(q, att.q_norm.weight)
            k = self._rms_norm(k, att.k_norm.weight)
        return QKV(self._rope(q, rope), self._rope(k, rope), v)

    def finish_layer(self, index: int, x: Tensor, attended: Tensor) -> Residual:
        """The residual stream after layer ``index``, given its stream x and its attention
        output [T, heads*dim] (this rank's heads), its MLP's output not added yet
        (:class:`Residual`): o and down are row-parallel, summed over the ranks."""
        layer = self.decoder_layers[index]
        o = layer.self_attn.o_proj
        projected = self.group.all_reduce(F.linear(attended, o.weight))
        projected = projected if o.bias is None else projected + o.bias
        norm, mlp = layer.post_attention_layernorm.weight, layer.mlp
        if self.kernels is not None and self.stacked is not None:
            # The add and the norm in one kernel, the gate and up in one GEMM, SiLU and the
            # product in one kernel (kernels/rms_norm.py, kernels/activation.py).
            x, h = self.kernels.add_norm(x, projected, norm, self.config.norm_eps)
            gated = self.kernels.silu_mul(F.linear(h, self.stacked[index].gate_up))
        else:
            x = x + projected
            h = self._rms_norm(x, norm)
            gated = F.silu(F.linear(h, mlp.gate_proj.weight)) * F.linear(h, mlp.up_proj.weight)
        return Residual(x, self.group.all_reduce(F.linear(gated, mlp.down_proj.weight)))

    def logits(self, x: Tensor) -> Tensor:
        """Final norm and LM head: logits [T, vocab] of hidden states [T, hidden]."""
        return F.linear(self._rms_norm(x, self.model.norm.weight), self.lm_head.weight)

    @torch.inference_mode()
    def forward_contiguous(self, token_ids: Tensor) -> Tensor:
        """Logits [T, vocab] of one whole sequence at positions 0..T-1 (the reference)."""
        length = token_ids.shape[0]
        if length > self.config.max_position:
            raise ValueError(f"sequence length {length} past max_position")
        positions = torch.arange(length)
        window = self.config.sliding_window
        mask = None  # plain causal attention, unless the window is shorter than the sequence
        if window is not None and window < length:
            mask = window_mask(positions, positions, window).to(self.rope_cos.device)
        stream: Tensor | Residual = self.embed(token_ids)
        rope = self.rope(positions)
        for index in range(self.config.layers):
            x, h = self.layer_input(index, stream)
            q, k, v = self.attention_inputs(index, h, rope)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                attn_mask=mask, is_causal=mask is None, enable_gqa=True,
            )  # fmt: skip
            stream = self.finish_layer(index, x, out.transpose(0, 1).reshape(length, -1))
        return self.logits(stream.whole() if isinstance(stream, Residual) else stream)

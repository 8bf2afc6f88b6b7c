"""The shape of a decoder of one of the supported families, its tensors, and the presets.

Kept apart from ``actors/model/decoder.py`` (which holds the torch modules) so that the
supervisor and the Engine, which read a model's shape but never run it, do not
import torch. What each Hugging Face architecture sets here is stated once, in
``actors/model/families.py``; the model code reads only these fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

RopeKind = Literal["linear", "llama3"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeScaling:
    """A rotary frequency scaling, as transformers' ``modeling_rope_utils`` computes it."""

    kind: RopeKind  # "linear": every inverse frequency / factor; "llama3": by wavelength
    factor: float  # context extension factor (> 0)
    low_freq_factor: float = 1.0  # llama3: wavelengths past original/low_freq_factor get / factor
    high_freq_factor: float = 4.0  # llama3: those below original/high_freq_factor are kept
    original_max_position: int = 8192  # llama3: the pretraining context length

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"llama3 rope high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )
        if self.original_max_position < 1:
            raise ValueError(
                f"rope original_max_position must be >= 1, got {self.original_max_position}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """The shape of a decoder: sizes, and the flags in which the families differ."""

    vocab_size: int  # rows of the embedding and of the LM head
    hidden: int  # residual stream width
    layers: int  # decoder layers
    heads: int  # query heads
    kv_heads: int  # key/value heads (grouped-query attention: heads % kv_heads == 0)
    head_dim: int  # width of one head (need not be hidden // heads)
    intermediate: int  # SwiGLU inner width
    max_position: int = 2048  # positions 0..max_position-1 are valid
    rope_theta: float = 10_000.0  # rotary base
    rope_scaling: RopeScaling | None = None  # None: plain rotary frequencies
    tie_embeddings: bool = True  # lm_head.weight is model.embed_tokens.weight
    norm_eps: float = 1e-5  # RMSNorm epsilon
    family: str = "LlamaForCausalLM"  # the Hugging Face architecture (a key of FAMILIES)
    qkv_bias: bool = False  # q_proj, k_proj and v_proj carry biases
    o_bias: bool = False  # o_proj carries a bias
    qk_norm: bool = False  # per-head RMSNorm of queries and keys over head_dim, before rotary
    sliding_window: int | None = None  # a query at i sees keys j with i - window < j <= i

    def __post_init__(self) -> None:
        for key in (
            "vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate",
            "max_position",
        ):  # fmt: skip
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model.heads ({self.heads}) must be a multiple of kv_heads")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim must be even for rotary, got {self.head_dim}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"model.sliding_window must be >= 1, got {self.sliding_window}")


def expected_tensors(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """The state-dict names and shapes of the model of ``shape``, in the model's order.

    ``lm_head.weight`` is listed even when tied (a tied checkpoint may omit it). The one
    definition that both the loader and the launch-time check compare checkpoints with.
    """
    c = shape
    q_width, kv_width = c.heads * c.head_dim, c.kv_heads * c.head_dim
    layer: dict[str, tuple[int, ...]] = {"self_attn.q_proj.weight": (q_width, c.hidden)}
    if c.qkv_bias:
        layer["self_attn.q_proj.bias"] = (q_width,)
    layer["self_attn.k_proj.weight"] = (kv_width, c.hidden)
    if c.qkv_bias:
        layer["self_attn.k_proj.bias"] = (kv_width,)
    layer["self_attn.v_proj.weight"] = (kv_width, c.hidden)
    if c.qkv_bias:
        layer["self_attn.v_proj.bias"] = (kv_width,)
    layer["self_attn.o_proj.weight"] = (c.hidden, q_width)
    if c.o_bias:
        layer["self_attn.o_proj.bias"] = (c.hidden,)
    if c.qk_norm:
        layer["self_attn.q_norm.weight"] = (c.head_dim,)
        layer["self_attn.k_norm.weight"] = (c.head_dim,)
    layer |= {
        "mlp.gate_proj.weight": (c.intermediate, c.hidden),
        "mlp.up_proj.weight": (c.intermediate, c.hidden),
        "mlp.down_proj.weight": (c.hidden, c.intermediate),
        "input_layernorm.weight": (c.hidden,),
        "post_attention_layernorm.weight": (c.hidden,),
    }
    layers = {f"model.layers.{i}.{k}": d for i in range(c.layers) for k, d in layer.items()}
    return {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden),
        **layers,
        "model.norm.weight": (c.hidden,),
        "lm_head.weight": (c.vocab_size, c.hidden),
    }


PRESETS: dict[str, ModelShape] = {
    # Byte-level vocabulary: 256 bytes + bos, eos, pad (see actors/text/tokenizer.py).
    "tiny": ModelShape(
        vocab_size=259, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128
    ),
    # "tiny" with four KV heads (eight query heads of 8): it splits over tp_size 1, 2 or 4.
    "tiny-4kv": ModelShape(
        vocab_size=259, hidden=64, layers=2, heads=8, kv_heads=4, head_dim=8, intermediate=128
    ),
    # 20,980,224 parameters (embedding 2,097,152 tied; 2,360,320 per layer; final norm 512).
    # KV block at block_size 16: layers*2*block_size*kv_heads*head_dim*dtype_size
    # = 8*2*16*4*64*4 = 262,144 bytes (256 KiB) in float32, 128 KiB in bfloat16.
    "small": ModelShape(
        vocab_size=4096, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1024
    ),
}

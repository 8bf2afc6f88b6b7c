"""The shape of a Llama-architecture decoder, and the built-in presets.

Kept apart from ``actors/model/decoder.py`` (which holds the torch modules) so that the
supervisor and the Engine, which read a model's shape but never run it, do not
import torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """The shape of a Llama-architecture decoder."""

    vocab_size: int  # rows of the embedding and of the LM head
    hidden: int  # residual stream width
    layers: int  # decoder layers
    heads: int  # query heads
    kv_heads: int  # key/value heads (grouped-query attention: heads % kv_heads == 0)
    head_dim: int  # width of one head
    intermediate: int  # SwiGLU inner width
    max_position: int = 2048  # positions 0..max_position-1 are valid
    rope_theta: float = 10_000.0  # rotary base
    tie_embeddings: bool = True  # lm_head.weight is model.embed_tokens.weight
    norm_eps: float = 1e-5  # RMSNorm epsilon

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim"):
            if getattr(self, key) < 1:
                raise ValueError(f"model.{key} must be >= 1, got {getattr(self, key)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model.heads ({self.heads}) must be a multiple of kv_heads")
        if self.head_dim % 2:
            raise ValueError(f"model.head_dim must be even for rotary, got {self.head_dim}")
        if self.max_position < 2048:
            raise ValueError(f"model.max_position must be >= 2048, got {self.max_position}")


PRESETS: dict[str, ModelShape] = {
    # Byte-level vocabulary: 256 bytes + bos, eos, pad (see actors/model/tokenizer.py).
    "tiny": ModelShape(
        vocab_size=259, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128
    ),
    # 20,980,224 parameters (embedding 2,097,152 tied; 2,360,320 per layer; final norm 512).
    # KV block at block_size 16: layers*2*block_size*kv_heads*head_dim*dtype_size
    # = 8*2*16*4*64*4 = 262,144 bytes (256 KiB) in float32, 128 KiB in bfloat16.
    "small": ModelShape(
        vocab_size=4096, hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, intermediate=1024
    ),
}

"""Small transformers checkpoints of every supported family, saved the way transformers saves them.

``save_family`` builds a seeded model of one family from its transformers config class
(hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 300), gives it non-trivial random
weights and writes it with ``save_pretrained``; ``float64_throughout`` makes transformers
compute in float64 where it otherwise forces float32, so that a float64 comparison
with our model is exact to rounding. Importing this module does not import transformers.
"""

from __future__ import annotations

import unittest.mock
from pathlib import Path
from typing import Any

import torch

FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM")
VOCAB = 300
SMALL: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
}
# What each family's config adds to SMALL (Qwen3's head_dim differs from hidden / heads).
EXTRA: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {},
    "Qwen2ForCausalLM": {},
    "Qwen3ForCausalLM": {"head_dim": 24},
    "MistralForCausalLM": {"sliding_window": None},
}


def family_config(family: str, **overrides: Any) -> Any:
    """The transformers config of a small model of ``family``, with overrides."""
    import transformers

    config_class = getattr(transformers, family.replace("ForCausalLM", "Config"))
    return config_class(**{**SMALL, **EXTRA[family], **overrides})


def save_family(
    root: Path,
    family: str,
    *,
    seed: int,
    max_shard_size: str | None = None,
    **config_overrides: Any,
) -> Any:
    """A seeded small transformers model of ``family`` with non-trivial weights, saved under root.

    Norm weights are 1 + 0.1 * noise, every other parameter (biases too) 0.2 * noise, all
    drawn from a generator seeded by ``seed``. Returned in eval mode, in float32.
    """
    import transformers

    config = family_config(family, **config_overrides)
    torch.manual_seed(seed)
    hf = getattr(transformers, family)(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    hf.save_pretrained(root, **kwargs)
    return hf.eval()


def transformers_logits(hf: Any, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' logits [T, vocab] of one sequence, its model cast to ``dtype``."""
    with torch.no_grad():
        logits: torch.Tensor = hf.to(dtype)(ids[None], use_cache=False).logits[0]
        return logits


def float64_throughout(hf: Any) -> torch.Tensor:
    """Make transformers compute in float64 where it forces float32 even in a float64 model.

    Its rotary tables and its RMSNorm statistics (q_norm/k_norm included) are always
    float32; ours follow the dtype. The inverse frequencies come from transformers' own
    rope functions (default, linear, llama3, ...), evaluated with ``torch.float`` standing
    for float64. Returns them.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rotary = hf.model.rotary_emb
    init = (
        rotary.compute_default_rope_parameters
        if rotary.rope_type == "default"
        else ROPE_INIT_FUNCTIONS[rotary.rope_type]
    )
    with unittest.mock.patch.object(torch, "float", torch.float64):
        inv_freq, scaling = init(hf.config)
    assert inv_freq.dtype == torch.float64 and scaling == 1.0

    def rotary_forward(
        x: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].to(torch.float64) * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)

    def norm(module: Any) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
            scaled: torch.Tensor = module.weight * (x * scale)
            return scaled

        return forward

    rotary.forward = rotary_forward
    for module in hf.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = norm(module)
    return inv_freq

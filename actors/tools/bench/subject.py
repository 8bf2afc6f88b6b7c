"""What ``ringfence bench worker`` runs on both sides: a preset or a checkpoint directory.

A preset has no transformers config of its own, so transformers gets a
``LlamaForCausalLM`` built from our weights (:func:`preset_in_transformers`); a
checkpoint of any supported family is loaded by each side from its files
(``load_checkpoint`` and ``AutoModelForCausalLM.from_pretrained``). torch and the model
are imported only when a subject is loaded, so the ``ringfence`` command starts fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ringfence.actors.model.decoder import Model

SEED = 0  # the presets' weights


def preset_in_transformers(transformers: Any, model: Model) -> Any:
    """A transformers ``LlamaForCausalLM`` of ``model``'s config holding its weights, in its dtype.

    Built in float32 from the float32 state dict; a bfloat16 copy keeps transformers'
    rotary frequencies in float32, as ``from_pretrained(dtype=torch.bfloat16)`` does.
    """
    import torch

    c = model.config
    config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden,
        intermediate_size=c.intermediate,
        num_hidden_layers=c.layers,
        num_attention_heads=c.heads,
        num_key_value_heads=c.kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="sdpa",  # what our path uses, and transformers' default on CPU
    )
    hf = transformers.LlamaForCausalLM(config).eval().requires_grad_(False)
    ours = {name: t.to(torch.float32) for name, t in model.state_dict().items()}
    theirs = hf.state_dict()
    missing, extra = sorted(set(theirs) - set(ours)), sorted(set(ours) - set(theirs))
    if missing or extra:
        raise RuntimeError(
            f"state dicts differ: transformers has {missing} that we lack, we have {extra}"
        )
    hf.load_state_dict(ours, strict=True)
    if c.tie_embeddings and hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("transformers did not tie lm_head.weight to the embedding")
    if model.dtype != torch.float32:
        rotary = {name: b.clone() for name, b in hf.model.rotary_emb.named_buffers()}
        hf.to(model.dtype)
        for name, buffer in rotary.items():
            setattr(hf.model.rotary_emb, name, buffer)
    return hf


@dataclass(frozen=True, slots=True, kw_only=True)
class Subject:
    """What is benchmarked: a checkpoint (a directory or a GGUF file) when ``checkpoint`` is
    set, else a preset."""

    preset: str | None = None  # a key of PRESETS
    checkpoint: str | None = None  # a Hugging Face checkpoint directory or a GGUF file

    def load(self, dtype: torch.dtype, transformers: Any, device: str = "cpu") -> tuple[Model, Any]:
        """Our model and transformers' of the same weights, both in ``dtype`` on ``device``, in
        eval mode (each loaded on the CPU, then moved)."""
        from ringfence.actors.model.checkpoint import load_checkpoint
        from ringfence.actors.model.decoder import Model

        if self.checkpoint is None:
            assert self.preset is not None
            model = Model.from_preset(self.preset, dtype, SEED)
            hf = preset_in_transformers(transformers, model)
            return model.to(device), hf.to(device)
        model = load_checkpoint(self.checkpoint, dtype=dtype).eval()
        path = Path(self.checkpoint)
        # A GGUF file: transformers reads it from its folder by name (and dequantizes it too).
        source = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent) if source else self.checkpoint,
            dtype=dtype,
            attn_implementation="sdpa",
            **source,
        )
        return model.to(device), hf.eval().requires_grad_(False).to(device)

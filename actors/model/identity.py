"""A model's identity and shape from the ``[model]`` section, without loading its weights.

Every actor derives them alike (the block keys' fingerprint holds the identity, the KV
layouts the shape), and none of it imports torch: the Engine and the supervisor read
shapes but never run a tensor.
"""

from __future__ import annotations

from ringfence.actors.model.checkpoint import checkpoint_fingerprint_id
from ringfence.actors.model.config import ModelConfig
from ringfence.actors.model.families import read_config
from ringfence.actors.model.gguf_checkpoint import gguf_shape
from ringfence.actors.model.shape import PRESETS, ModelShape
from ringfence.actors.text.gguf_metadata import is_gguf


def model_id(settings: ModelConfig) -> str:
    """The identity of the model and its weights: ``model.path`` before ``model.preset``."""
    if settings.path:
        return checkpoint_fingerprint_id(settings.path)
    return f"preset-{settings.preset}-seed{settings.seed}"


def model_shape(settings: ModelConfig) -> ModelShape:
    """The architecture the settings name, without loading weights."""
    if settings.path:
        return gguf_shape(settings.path) if is_gguf(settings.path) else read_config(settings.path)
    if settings.preset not in PRESETS:
        raise ValueError(f"unknown model preset {settings.preset!r}; known: {sorted(PRESETS)}")
    return PRESETS[settings.preset]

"""The shapes every actor of a rank agrees on, derived from the config alone.

The Worker, the two Transfer lanes and the Engine each compute the same KV layouts,
model identity and block fingerprint from the same ``[model]`` and ``[cache]``
settings, without loading any weights (a checkpoint's config.json is enough for the
shape; its identity hashes the weight files once).
"""

from __future__ import annotations

from ringfence.actors.config import Config
from ringfence.actors.kv.space import LAYOUT_NAME, KVLayout
from ringfence.actors.model.checkpoint import checkpoint_fingerprint_id, read_config
from ringfence.actors.model.config import ModelConfig as ModelSettings
from ringfence.actors.model.shape import PRESETS, ModelShape
from ringfence.cache.block_hash import Fingerprint
from ringfence.cache.fences import Tier

STAGING_BLOCKS = 64  # host blocks when cache.host_blocks = 0: storage traffic stages here


def model_id(settings: ModelSettings) -> str:
    """The identity of the model and its weights: ``model.path`` before ``model.preset``."""
    if settings.path:
        return checkpoint_fingerprint_id(settings.path)
    return f"preset-{settings.preset}-seed{settings.seed}"


def model_shape(settings: ModelSettings) -> ModelShape:
    """The architecture the settings name, without loading weights."""
    if settings.path:
        return read_config(settings.path)
    if settings.preset not in PRESETS:
        raise ValueError(f"unknown model preset {settings.preset!r}; known: {sorted(PRESETS)}")
    return PRESETS[settings.preset]


def kv_layout(config: Config, tier: Tier, shape: ModelShape | None = None) -> KVLayout:
    """The block-major KV layout of ``tier`` (device or host) at this config."""
    shape = shape or model_shape(config.model)
    if tier == Tier.DEVICE:
        blocks = config.cache.device_blocks
    else:
        blocks = config.cache.host_blocks or STAGING_BLOCKS
    return KVLayout(
        num_blocks=blocks,
        layers=shape.layers,
        block_size=config.cache.block_size,
        kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        dtype=config.model.dtype,
    )


def block_fingerprint(config: Config, identity: str | None = None) -> Fingerprint:
    """What namespaces every block key (and every stored blob) of this model and layout."""
    return Fingerprint(
        model_id=identity if identity is not None else model_id(config.model),
        dtype=config.model.dtype,
        block_size=config.cache.block_size,
        kv_layout=LAYOUT_NAME,
        tp_size=1,
        tp_rank=0,
    )

"""The KV layouts and block fingerprint every actor of a rank agrees on, from the config alone.

The Worker, the two Transfer lanes and the Engine each compute the same KV layouts and
block fingerprint from the same ``[model]``, ``[cache]`` and ``[parallel]`` settings
(:class:`KVSections`), without loading any weights (``actors/model/identity.py``: a
checkpoint's config.json is enough for the shape; its identity hashes the weight files
once).
"""

from __future__ import annotations

from typing import Protocol

from ringfence.actors.kv.space import LAYOUT_NAME, KVLayout
from ringfence.actors.model.config import ModelConfig, ParallelConfig
from ringfence.actors.model.identity import model_id, model_shape
from ringfence.actors.model.shape import ModelShape
from ringfence.cache.block_hash import Fingerprint
from ringfence.cache.config import CacheConfig
from ringfence.cache.fences import Tier

STAGING_BLOCKS = 64  # host blocks when cache.host_blocks = 0: storage traffic stages here


class KVSections(Protocol):
    """The sections the layouts and the fingerprint are computed from: an actor's settings
    that declare them, or the run's whole config."""

    @property
    def model(self) -> ModelConfig: ...
    @property
    def cache(self) -> CacheConfig: ...
    @property
    def parallel(self) -> ParallelConfig: ...


def kv_layout(config: KVSections, tier: Tier, shape: ModelShape | None = None) -> KVLayout:
    """The block-major KV layout of ``tier`` (device or host) at this config, on one rank:
    each rank holds its share of the KV heads of every block (``parallel.tp_size`` must
    divide them; ValueError naming both otherwise)."""
    shape = shape or model_shape(config.model)
    ranks = config.parallel.tp_size
    if shape.kv_heads % ranks:
        raise ValueError(
            f"parallel.tp_size ({ranks}) must divide the model's {shape.kv_heads} KV heads"
        )
    if tier == Tier.DEVICE:
        blocks = config.cache.device_blocks
    else:
        blocks = config.cache.host_blocks or STAGING_BLOCKS
    return KVLayout(
        num_blocks=blocks,
        layers=shape.layers,
        block_size=config.cache.block_size,
        kv_heads=shape.kv_heads // ranks,
        head_dim=shape.head_dim,
        dtype=config.model.dtype,
    )


def block_fingerprint(
    config: KVSections, identity: str | None = None, rank: int = 0
) -> Fingerprint:
    """What namespaces every block key (and every stored blob) of this model and layout, at
    ``rank``: each rank stores its own shard of a block under its own fingerprint."""
    return Fingerprint(
        model_id=identity if identity is not None else model_id(config.model),
        dtype=config.model.dtype,
        block_size=config.cache.block_size,
        kv_layout=LAYOUT_NAME,
        tp_size=config.parallel.tp_size,
        tp_rank=rank,
    )

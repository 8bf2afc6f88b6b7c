"""The scheduler's settings, built from the engine's sections (:class:`SchedSections`) and
the model its Worker announced (the in-process runner and replay's redrive build the same)."""

from __future__ import annotations

from typing import Protocol

from ringfence.actors.engine.config import EngineConfig
from ringfence.actors.kv.layout import STAGING_BLOCKS, KVSections, block_fingerprint
from ringfence.cache.storage.registry import NO_TIER
from ringfence.sched.config import SchedConfig, SchedulerConfig, TierConfig, max_model_len


class SchedSections(KVSections, Protocol):
    """The sections the scheduler's settings come from: the block fingerprint's, ``[sched]``,
    and ``[engine]`` (its role); the Engine's settings, or the run's whole config."""

    @property
    def sched(self) -> SchedConfig: ...
    @property
    def engine(self) -> EngineConfig: ...


def sched_config(
    config: SchedSections, model_id: str, max_position: int, vocab_size: int = 1 << 31
) -> SchedulerConfig:
    """The scheduler's settings: ``[sched]``, ``[cache]`` and the model's identity and limits
    (the model's ``ModelInfo.model_id``, ``max_position`` and ``vocab_size``), and the steps
    it may keep in flight (``sched.steps_in_flight``, 1 for a prefill instance or under
    tensor parallelism). ValueError
    where ``sched.max_model_len`` is past the model's ``max_position``."""
    cache = config.cache
    storage = cache.storage.backend != NO_TIER
    tiers = TierConfig(
        block_size=cache.block_size,
        device_blocks=cache.device_blocks,
        host_blocks=cache.host_blocks or STAGING_BLOCKS,
        host_cache=cache.host_blocks > 0,
        storage=storage,
        device_eviction=cache.device_eviction,
        host_eviction=cache.host_eviction,
        poison_freed=cache.poison_freed,
    )
    prefill, tp = config.engine.role == "prefill", config.parallel.tp_size
    return SchedulerConfig(
        sched=config.sched,
        tiers=tiers,
        namespace=block_fingerprint(config, model_id).digest(),
        max_model_len=max_model_len(config.sched, max_position),
        vocab_size=vocab_size,
        handover=prefill,
        # One at a time where two cannot hold (SchedulerConfig.steps_in_flight says why).
        steps_in_flight=1 if prefill or tp > 1 else config.sched.steps_in_flight,
    )

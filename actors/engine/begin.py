"""The engine's beginning: what it builds once every executor answered its Resync
(:mod:`.executors`).

It builds (:func:`begin_scheduler`) every rank's storage client, the scheduler's
settings (:func:`sched_config`, checked against the model the Worker loaded; the in-process
runner and replay's redrive build the same), the KV events' publisher when
``events.enabled``, and the scheduler itself, numbering each lane's ops after the
watermarks the executors answered with.

Engine thread; ``begin_scheduler`` is called once per engine incarnation (``Engine.begin``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ringfence.actors.engine.config import EngineConfig, EngineSettings
from ringfence.actors.engine.kv_events import KVEventsOut
from ringfence.actors.engine.storage import LoggedPresence, open_all_ranks
from ringfence.actors.kv.layout import STAGING_BLOCKS, KVSections, block_fingerprint
from ringfence.actors.model.info import ModelInfo
from ringfence.cache.fences import Lane
from ringfence.cache.storage.ranks import AllRanks
from ringfence.cache.storage.registry import NO_TIER
from ringfence.runtime.log import ActorLog
from ringfence.sched.config import SchedConfig, SchedulerConfig, TierConfig, max_model_len
from ringfence.sched.scheduler import Scheduler

# The scheduler's settings.


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


# What the engine builds when it begins.


@dataclass(frozen=True, slots=True)
class Begun:
    """The engine's scheduler and what it holds open: close ``storage`` and ``kv_out``."""

    scheduler: Scheduler
    storage: AllRanks | None
    kv_out: KVEventsOut | None


def begin_scheduler(
    config: EngineSettings,
    model: ModelInfo,
    first: Mapping[Lane, int],
    run_dir: str,
    log: ActorLog,
) -> Begun:
    """See the module docstring. At trace level the scheduler journals its decisions and
    keeps each op's declared sets, and storage answers are logged (for replay). Raises
    ValueError when the settings do not fit the model (nothing is left open then)."""
    storage = open_all_ranks(config, model, run_dir, log=log)
    try:
        settings = sched_config(config, model.model_id, model.max_position, model.vocab_size)
    except ValueError:
        if storage is not None:
            storage.close()
        raise
    tracing = log.tracing
    presence = LoggedPresence(storage, log) if tracing and storage else None
    kv_out = KVEventsOut(config.events, settings.tiers, log) if config.events.enabled else None
    scheduler = Scheduler(
        settings,
        presence or storage,
        journal=tracing,
        first_numbers=first,
        kv_events=None if kv_out is None else kv_out.journal,
    )
    return Begun(scheduler, storage, kv_out)

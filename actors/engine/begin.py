"""What the engine builds once every executor answered its Resync: every rank's storage
client, the scheduler's settings (checked against the model the Worker loaded), the KV
events' publisher when ``events.enabled``, and the scheduler itself, numbering each lane's
ops after the watermarks the executors answered with.

Engine thread; called once per engine incarnation (``Engine._maybe_begin``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ringfence.actors.engine.config import EngineSettings
from ringfence.actors.engine.kv_events import KVEventsOut
from ringfence.actors.engine.sched_settings import sched_config
from ringfence.actors.engine.storage import LoggedPresence, open_all_ranks
from ringfence.actors.model.info import ModelInfo
from ringfence.cache.fences import Lane
from ringfence.cache.storage.ranks import AllRanks
from ringfence.runtime.log import ActorLog
from ringfence.sched.scheduler import Scheduler


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

"""The scheduler and the storage client the engine runs with, built from the run's config
and the model its Worker announced (the in-process runner and replay's redrive build the
same)."""

from __future__ import annotations

from collections.abc import Sequence

from ringfence.actors.config import Config
from ringfence.actors.kv.layout import STAGING_BLOCKS, block_fingerprint
from ringfence.actors.model.identity import model_shape
from ringfence.actors.model.info import ModelInfo
from ringfence.cache.ids import BlockHash
from ringfence.cache.prefix_index import StoragePresence
from ringfence.cache.storage import StorageLog, open_backend, stdlib_log
from ringfence.cache.storage.guarded import GuardedBackend
from ringfence.cache.storage.ranks import AllRanks, RankLog
from ringfence.runtime.extras import require
from ringfence.runtime.log import ActorLog
from ringfence.sched.config import SchedulerConfig, TierConfig


def max_model_len(config: Config, max_position: int) -> int:
    """The longest prompt plus max_tokens a request may ask for: ``sched.max_model_len``, or
    the model's ``max_position`` where it is 0. ValueError naming the key and both numbers
    where it asks for more positions than the model has."""
    wanted = config.sched.max_model_len
    if wanted > max_position:
        raise ValueError(
            f"sched.max_model_len is {wanted}, more than the model's {max_position} positions "
            "(max_position_embeddings); set it to at most that, or 0 for the model's own"
        )
    return wanted or max_position


def check_limits(config: Config) -> None:
    """The launch's check of ``sched.max_model_len`` against the model the config names,
    before a run exists (ValueError naming the key; the runtime knows it only by name)."""
    max_model_len(config, model_shape(config.model).max_position)


def check_storage(config: Config) -> None:
    """The launch's check that the storage backend's client library is installed (the
    engine and the store lanes import it in their own processes, where a missing one would
    be an actor's failure): MissingExtra naming the extra that installs it."""
    if config.cache.storage.backend == "redis":
        require("redis", "cache.storage.backend = 'redis'")


def check_role(config: Config) -> None:
    """The launch's check of ``engine.role`` against the rest of the config (ValueError
    naming the keys): a prefill or decode instance shares KV through a storage tier that
    another instance can reach, and a decode instance preempts by ``save``."""
    role, storage = config.engine.role, config.cache.storage
    if role == "both":
        return
    where = "a directory every instance of the pair uses (cache.storage.path)"
    if storage.backend in ("none", "memory"):
        raise ValueError(
            f"engine.role = {role!r} hands KV over through a shared storage tier, but "
            f"cache.storage.backend is {storage.backend!r}: use 'local' with {where}, or "
            "'redis' with the server's cache.storage.url"
        )
    if storage.backend == "local" and not storage.path:
        raise ValueError(
            f"engine.role = {role!r} hands KV over through a shared storage tier, but "
            "cache.storage.path is empty (the run's own directory, which no other instance "
            f"reads): set it to {where}"
        )
    if role == "decode" and config.sched.preemption != "save":
        raise ValueError(
            "engine.role = 'decode' preempts by writing to the shared tier: set "
            f"sched.preemption = 'save' (it is {config.sched.preemption!r})"
        )
    if role == "decode" and config.engine.workload:
        raise ValueError(
            "engine.role = 'decode' takes requests only by reservation (through "
            "'ringfence router'); engine.workload would run none of them"
        )


def sched_config(
    config: Config, model_id: str, max_position: int, vocab_size: int = 1 << 31
) -> SchedulerConfig:
    """The scheduler's settings: ``[sched]``, ``[cache]`` and the model's identity and limits
    (the model's ``ModelInfo.model_id``, ``max_position`` and ``vocab_size``). ValueError
    where ``sched.max_model_len`` is past the model's ``max_position``."""
    cache = config.cache
    storage = cache.storage.backend != "none"
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
    return SchedulerConfig(
        sched=config.sched,
        tiers=tiers,
        namespace=block_fingerprint(config, model_id).digest(),
        max_model_len=max_model_len(config, max_position),
        vocab_size=vocab_size,
        handover=config.engine.role == "prefill",
    )


def open_storage(
    config: Config, model: ModelInfo, run_dir: str, *, log: StorageLog | None = None
) -> AllRanks | None:
    """The storage tier's client (the engine asks it what is stored), or None.

    One client per rank, each under that rank's fingerprint (the key space its store
    lane writes), behind :class:`AllRanks`: a block is present only where every rank's
    shard is. Each is guarded (:class:`GuardedBackend`): while its tier is unreachable
    its presence answer is "nothing stored" and ``storage.unavailable`` goes to ``log``
    (default: the stdlib logger ``ringfence.cache.storage``), with ``tp_rank``, once
    per outage. A server that is down when it opens is such an outage from the start
    (``storage.unreachable``), not an error.
    """
    settings = config.cache.storage
    if settings.backend == "none":
        return None
    path = settings.path or (f"{run_dir}/storage" if settings.backend == "local" else "")
    clients: list[GuardedBackend] = []
    try:
        for rank in range(config.parallel.tp_size):
            rank_log = RankLog(log if log is not None else stdlib_log(), rank)
            backend = open_backend(
                settings.backend,
                fingerprint=block_fingerprint(config, model.model_id, rank).digest(),
                path=path,
                url=settings.url,
                max_bytes=settings.max_bytes,
                timeout_s=settings.timeout_s,
                log=rank_log,
                require_server=False,  # down at launch: misses until it is up, like an outage
            )
            clients.append(
                GuardedBackend(backend, log=rank_log, answer_s=settings.presence_timeout_s)
            )
    except BaseException:  # a later rank's failed: close the ranks opened before it
        for client in clients:
            client.close()
        raise
    return AllRanks(clients)


class LoggedPresence:
    """The storage tier's presence answers, each logged (``sched.storage``) so that a
    replay can give a fresh scheduler the same answers without the storage."""

    def __init__(self, backend: StoragePresence, log: ActorLog) -> None:
        self.backend = backend
        self.log = log

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        found = self.backend.longest_prefix(keys)
        self.log.trace("sched.storage", asked=len(keys), found=found)
        return found

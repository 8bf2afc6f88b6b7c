"""The engine's client of the storage tier: what every rank's store lane holds, asked as one.

The engine only asks what is stored (``longest_prefix``); the store lanes write and read.
"""

from __future__ import annotations

from collections.abc import Sequence

from ringfence.actors.kv.layout import KVSections, block_fingerprint
from ringfence.actors.model.info import ModelInfo
from ringfence.cache.ids import BlockHash
from ringfence.cache.prefix_index import StoragePresence
from ringfence.cache.storage import StorageLog, stdlib_log
from ringfence.cache.storage.guarded import GuardedBackend
from ringfence.cache.storage.ranks import AllRanks, RankLog
from ringfence.cache.storage.registry import NO_TIER, open_storage
from ringfence.runtime.log import ActorLog


def open_all_ranks(
    config: KVSections, model: ModelInfo, run_dir: str, *, log: StorageLog | None = None
) -> AllRanks | None:
    """The storage tier's client (the engine asks it what is stored), or None: from
    ``cache.storage``, one fingerprint per rank of ``parallel.tp_size``.

    One client per rank, each under that rank's fingerprint (the key space its store
    lane writes), behind :class:`AllRanks`: a block is present only where every rank's
    shard is. Each is guarded (:class:`GuardedBackend`): while its tier is unreachable
    its presence answer is "nothing stored" and ``storage.unavailable`` goes to ``log``
    (default: the stdlib logger ``ringfence.cache.storage``), with ``tp_rank``, once
    per outage. A server that is down when it opens is such an outage from the start
    (``storage.unreachable``), not an error.
    """
    settings = config.cache.storage
    if settings.backend == NO_TIER:
        return None
    clients: list[GuardedBackend] = []
    try:
        for rank in range(config.parallel.tp_size):
            rank_log = RankLog(log if log is not None else stdlib_log(), rank)
            backend = open_storage(
                settings,
                fingerprint=block_fingerprint(config, model.model_id, rank).digest(),
                run_dir=run_dir,
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

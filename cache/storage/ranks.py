"""The storage tier as the engine sees it over every rank: a block is present only where
every rank's shard of it is (docs/design.md, "Ranks (tensor parallelism)").

With ``parallel.tp_size`` = N, rank r's store lane writes its shard of a block under the
block's key and rank r's fingerprint, so each rank has a key space of its own (local: a
directory per fingerprint; redis: a key prefix per fingerprint). The engine opens one
client per rank's fingerprint and asks :class:`AllRanks`, whose ``longest_prefix`` is the
least of the ranks' answers: a prefix that rank 0 holds whole but rank 1 lacks block k of
is present up to block k. The ranks are asked in order, each only about the prefix the
ranks before it hold, so a miss at rank 0 costs one question and a full hit N.

Each rank's client keeps its own outage state (the engine's are
:class:`~.guarded.GuardedBackend`): a rank whose tier cannot be reached answers 0, and so
does the whole, while the others are not asked. A blob that is corrupt at one rank
counts as present here (presence reads no payload, as for one backend); the prefetch
then reports the block missing at that rank, the engine's ledger takes the union of the
ranks' missing blocks, and the engine recomputes it.

What each rank's client logs carries ``tp_rank`` (:class:`RankLog`), so an outage or a
corrupt blob names the rank whose key space it was in.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence

from ringfence.cache.ids import BlockHash
from ringfence.cache.storage.backend import StorageBackend, StorageLog, StorageStats


class RankLog:
    """A :class:`~ringfence.cache.storage.StorageLog` that adds ``tp_rank`` to every event
    before passing it on to ``log``."""

    def __init__(self, log: StorageLog, rank: int) -> None:
        self.log = log
        self.rank = rank

    def error(self, event: str, **fields: object) -> None:
        self.log.error(event, **fields, tp_rank=self.rank)

    def warning(self, event: str, **fields: object) -> None:
        self.log.warning(event, **fields, tp_rank=self.rank)

    def info(self, event: str, **fields: object) -> None:
        self.log.info(event, **fields, tp_rank=self.rank)


class AllRanks:
    """The presence of blocks over every rank's client; see the module docstring.

    ``ranks[r]`` is the client of rank r's fingerprint. Owner: one thread (the engine's);
    mutates nothing of its own, and each client only as its own ``longest_prefix`` does.
    """

    def __init__(self, ranks: Sequence[StorageBackend]) -> None:
        if not ranks:
            raise ValueError("AllRanks needs the storage client of at least one rank")
        self.ranks = tuple(ranks)
        self.name = self.ranks[0].name  # the registry name, the same for every rank

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        """How many leading ``keys`` every rank holds: the least of the ranks' answers."""
        found = len(keys)
        for client in self.ranks:
            if found == 0:
                break
            found = min(found, client.longest_prefix(keys[:found]))
        return found

    def stats(self) -> StorageStats:
        """Every counter summed over the ranks' clients."""
        each = [client.stats() for client in self.ranks]
        sums = {
            f.name: sum(getattr(stats, f.name) for stats in each)
            for f in dataclasses.fields(StorageStats)
        }
        return StorageStats(**sums)

    def close(self) -> None:
        """Close every rank's client, each even if closing another raised. Idempotent."""
        with contextlib.ExitStack() as closing:
            for client in reversed(self.ranks):  # the stack unwinds: rank 0 closes first
                closing.callback(client.close)

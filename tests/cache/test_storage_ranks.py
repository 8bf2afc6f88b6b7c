"""The storage tier over every rank: a prefix is present only as far as every rank's shards
are; each rank's client keeps its own outage; the ranks are closed together."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import pytest

from ringfence.actors.tools.testing.storage import RecordingLog, read_blob, write_blob
from ringfence.cache.ids import BlockHash
from ringfence.cache.storage import StorageUnavailable
from ringfence.cache.storage.guarded import GuardedBackend
from ringfence.cache.storage.memory import MemoryBackend
from ringfence.cache.storage.ranks import AllRanks, RankLog

FPS = [hashlib.blake2b(f"model-a rank {r}".encode(), digest_size=16).digest() for r in (0, 1)]
BLOCK = 1024


def key(i: int) -> BlockHash:
    return BlockHash(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest())


KEYS = [key(i) for i in range(4)]


class Rank(MemoryBackend):
    """One rank's key space: a memory backend that records the presence questions it gets,
    raises ``error`` to them while it is set, and can fail to close."""

    def __init__(self, rank: int, held: Sequence[int] = (), log: RecordingLog | None = None):
        super().__init__(fingerprint=FPS[rank], log=log)
        self.put_many([(key(i), bytes([rank]) * BLOCK) for i in held])
        self.asked: list[int] = []  # how many keys each question had
        self.error: Exception | None = None
        self.close_error: Exception | None = None

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        self.asked.append(len(keys))
        if self.error is not None:
            raise self.error
        return super().longest_prefix(keys)

    def close(self) -> None:
        super().close()
        if self.close_error is not None:
            raise self.close_error


def test_a_prefix_is_present_only_up_to_the_first_block_some_rank_lacks():
    assert AllRanks([Rank(0, held=(0, 1, 2, 3)), Rank(1, held=(0, 1, 3))]).longest_prefix(KEYS) == 2
    assert AllRanks([Rank(0, held=(1, 2, 3)), Rank(1, held=(0, 1, 2, 3))]).longest_prefix(KEYS) == 0
    assert AllRanks([Rank(0, held=(0, 1)), Rank(1, held=(0, 1, 2))]).longest_prefix(KEYS) == 2
    assert (
        AllRanks([Rank(0, held=(0, 1, 2, 3)), Rank(1, held=(0, 1, 2, 3))]).longest_prefix(KEYS) == 4
    )


def test_each_rank_is_asked_only_about_the_prefix_the_ranks_before_it_hold():
    rank0, rank1 = Rank(0, held=(0, 1)), Rank(1, held=(0,))
    storage = AllRanks([rank0, rank1])
    assert storage.longest_prefix(KEYS) == 1
    assert (rank0.asked, rank1.asked) == ([4], [2])
    assert storage.longest_prefix([key(7), *KEYS]) == 0
    assert (rank0.asked, rank1.asked) == ([4, 5], [2])  # rank 0 lacks the first: done
    assert storage.longest_prefix([]) == 0


def test_a_rank_whose_tier_is_down_is_a_miss_logged_with_its_rank_and_the_other_is_unaffected():
    log, now = RecordingLog(), [100.0]
    rank0, rank1 = Rank(0, held=(0, 1)), Rank(1, held=(0, 1))
    guards = [
        GuardedBackend(r, log=RankLog(log, n), backoff_s=0.5, clock=lambda: now[0])
        for n, r in enumerate((rank0, rank1))
    ]
    storage = AllRanks(guards)
    rank1.error = StorageUnavailable("redis at 127.0.0.1:1: refused")
    assert storage.longest_prefix(KEYS) == 0  # a miss, never an exception
    assert (guards[0].available, guards[1].available) == (True, False)
    assert [(line[1], line[2]["tp_rank"]) for line in log.lines] == [("storage.unavailable", 1)]
    rank1.error = None
    assert storage.longest_prefix(KEYS) == 0  # rank 1 is left alone during its back-off
    now[0] += 0.5
    assert storage.longest_prefix(KEYS) == 2
    assert [line[1] for line in log.lines] == ["storage.unavailable", "storage.restored"]
    assert len(rank1.asked) == 2 and len(rank0.asked) == 3


def test_a_corrupt_blob_at_one_rank_counts_as_present_and_reads_there_as_a_miss():
    log = RecordingLog()
    rank0, rank1 = Rank(0, held=(0, 1)), Rank(1, held=(0, 1), log=log)
    blob = read_blob(rank1, key(1))
    assert blob is not None
    write_blob(rank1, key(1), blob[:10] + bytes([blob[10] ^ 0xFF]) + blob[11:])  # a payload byte
    assert AllRanks([rank0, rank1]).longest_prefix(KEYS) == 2  # presence reads no payload
    assert rank0.get_many([key(1)]) == [bytes([0]) * BLOCK]
    assert rank1.get_many([key(1)]) == [None]  # the prefetch's miss at rank 1
    assert [fields["key"] for fields in log.events("storage.corrupt")] == [key(1).hex()]


def test_stats_are_summed_over_the_ranks():
    rank0, rank1 = Rank(0, held=(0, 1)), Rank(1, held=(0,))
    rank1.get_many([key(0), key(5)])
    stats = AllRanks([rank0, rank1]).stats()
    assert (stats.num_blocks, stats.num_puts, stats.hits, stats.misses) == (3, 3, 1, 1)
    assert stats.num_bytes == rank0.stats().num_bytes + rank1.stats().num_bytes


def test_closing_closes_every_rank_even_when_one_fails_to_close():
    rank0, rank1 = Rank(0), Rank(1)
    rank0.close_error = OSError("close failed")
    storage = AllRanks([rank0, rank1])
    with pytest.raises(OSError, match="close failed"):
        storage.close()
    for rank in (rank0, rank1):
        with pytest.raises(ValueError, match="closed"):
            rank.get_many([key(0)])
    rank0.close_error = None
    storage.close()  # again: quietly


def test_all_ranks_needs_at_least_one_rank():
    with pytest.raises(ValueError, match="at least one rank"):
        AllRanks([])

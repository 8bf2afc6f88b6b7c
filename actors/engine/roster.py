"""Who the engine's executors are: each (role, rank)'s incarnation, and its Resync answer.

An engine begins only once every executor of every rank has answered its ``Resync``
(DESIGN.md on epochs and restarts): the answer's watermark covers every op an engine
before it sent, so each lane's numbers go on after the largest of its ranks' answers.
Afterwards an announcement with a new incarnation is a restart: a Worker's means a new
device tier, a lane's that it redoes its op in flight from its ring.

Owned by the Engine actor; no I/O.
"""

from __future__ import annotations

from typing import NamedTuple

from ringfence.cache.fences import Lane

EXECUTORS = {"worker": Lane.STEP, "swap": Lane.SWAP, "store": Lane.STORE}


class Announced(NamedTuple):
    """An executor's announcement, as the engine takes it."""

    restarted: bool  # a new incarnation of an executor the engine had already heard from


class Roster:
    """The executors of ``ranks`` ranks, as announced to the engine of ``epoch``."""

    def __init__(self, epoch: int, ranks: int) -> None:
        self.epoch, self.ranks = epoch, ranks
        self.incarnations: dict[tuple[str, int], int] = {}  # the incarnation last announced
        self.synced: dict[tuple[str, int], int] = {}  # its watermark when it answered Resync

    def announce(
        self, role: str, rank: int, incarnation: int, resync: int, done: int, *, began: bool
    ) -> Announced | None:
        """Record an announcement; None if it answers another engine's Resync or comes from
        a rank the run does not have (ValueError is for the caller's protocol error)."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"{role} rank {rank} announced; the run has {self.ranks} ranks")
        if resync >= 0 and resync != self.epoch:
            return None
        if resync >= 0 and not began:
            self.synced[(role, rank)] = done
        known = self.incarnations.setdefault((role, rank), incarnation)
        self.incarnations[(role, rank)] = incarnation
        return Announced(restarted=known != incarnation)

    def all_synced(self) -> bool:
        """Whether every executor of every rank answered this engine's Resync."""
        return len(self.synced) == len(EXECUTORS) * self.ranks

    def first_numbers(self) -> dict[Lane, int]:
        """Each lane's first op number: after the largest watermark its ranks answered."""
        first = {}
        for role, lane in EXECUTORS.items():
            first[lane] = max(self.synced[(role, rank)] for rank in range(self.ranks)) + 1
        return first

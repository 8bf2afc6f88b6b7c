"""Restart groups: the ranks of a ``restart_together`` actor fail and restart as one.

The Worker's ranks share a torch.distributed process group that dies with any member,
and a device KV name and a rendezvous that two generations must never hold at once. So
when one rank of such an actor fails, the supervisor's restarts (restarts.py) do, in order:

1. the restart policy of the actor, applied to the group as one: its restart count is
   the group's (every rank's ``restarts`` is that count), ``max_restarts`` bounds it and
   the backoff doubles with it, as for a single instance; a group that has given up, or
   a rank whose start raised before it was ever ready, stops the run as for one instance;
2. :meth:`Groups.begin`: every rank is marked "restarting" under one backoff, and the
   siblings still running are returned for the supervisor to SIGKILL (by pid, processes it
   spawned); the supervisor logs one ``actor.group_restart`` and bumps the run epoch once;
3. a killed sibling's exit is logged but is no failure of its own (no restart count, no
   ``gave_up``, no epoch bump): its slot is already "restarting";
4. :meth:`Groups.due`: once every old rank process has exited (collected through the
   waker) and the backoff has passed, every rank is spawned again, all under one
   incarnation number (the Workers name their rendezvous after it). A killed rank still
   alive :data:`KILL_REAP_S` after the kill is reported stuck and the run stops.

Only ranks the supervisor spawns can be killed: an actor placed "external" is not treated
as a group (each rank is awaited alone, as any external instance).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ringfence.runtime.run import Slot
from ringfence.runtime.topology import Topology

KILL_REAP_S = 5.0  # a SIGKILLed child is gone in far less


@dataclass(frozen=True, slots=True, kw_only=True)
class Regroup:
    """One group restart under way."""

    group: str  # the actor's name
    cause: str  # the instance whose failure began it
    due: float  # monotonic time from which the ranks may spawn (the backoff's end)
    reap_by: float  # every old rank process must have exited by then


def ranks_of(slots: Sequence[Slot], name: str) -> list[Slot]:
    """The slots of actor ``name``'s ranks, in rank order."""
    return [s for s in slots if s.entry.name == name]


class Groups:
    """The ``restart_together`` actors of a topology and their group restarts under way.

    Bookkeeping only: it changes slots' states, counts and deadlines, never a process;
    the supervisor kills, logs and spawns. Main thread only, as the supervisor.
    """

    def __init__(self, topology: Topology) -> None:
        self._names = frozenset(
            a.name for a in topology.actors if a.restart_together and a.ranks > 1
        )
        self._pending: dict[str, Regroup] = {}

    def together(self, slot: Slot) -> bool:
        """Whether ``slot``'s failure restarts every rank of its actor."""
        return slot.entry.name in self._names and slot.entry.placement == "spawn"

    def begin(self, slots: Sequence[Slot], slot: Slot, *, backoff: float, now: float) -> list[Slot]:
        """Start a group restart for the failure of ``slot`` (its process already collected).

        Every rank becomes "restarting" with the group's restart count (``slot.restarts``
        plus one) and no deadline of its own (``math.inf``: the group's is :meth:`wakes`).
        Returns the siblings whose process is not yet collected: the supervisor SIGKILLs
        those still alive; their exits are no failures.
        """
        name = slot.entry.name
        assert self.together(slot) and name not in self._pending, slot.entry.id
        self._pending[name] = Regroup(
            group=name, cause=slot.entry.id, due=now + backoff, reap_by=now + KILL_REAP_S
        )
        running, restarts = [], slot.restarts + 1
        for rank in ranks_of(slots, name):
            if rank is not slot and rank.proc is not None:
                running.append(rank)
            rank.restarts, rank.state, rank.deadline = restarts, "restarting", math.inf
        return running

    def wakes(self, slots: Sequence[Slot]) -> Iterator[float]:
        """When each group restart needs the supervisor next: the reap deadline while an
        old rank process is left (its exit wakes the supervisor sooner), else the backoff's end."""
        for regroup in self._pending.values():
            old = any(s.proc is not None for s in ranks_of(slots, regroup.group))
            yield regroup.reap_by if old else regroup.due

    def due(self, slots: Sequence[Slot], now: float) -> tuple[list[list[Slot]], list[Slot]]:
        """(groups to spawn now, ranks stuck past their reap deadline).

        A group is due when none of its old rank processes is left and its backoff has
        passed; it is no longer pending once returned. Each due rank's incarnation is set
        to the group's highest, so that each spawn (which adds one) gives the same number.
        """
        ready: list[list[Slot]] = []
        stuck: list[Slot] = []
        for name, regroup in list(self._pending.items()):
            ranks = ranks_of(slots, name)
            left = [s for s in ranks if s.proc is not None]
            if left:
                if now >= regroup.reap_by:
                    stuck.extend(left)
                continue
            if now < regroup.due:
                continue
            del self._pending[name]
            incarnation = max(s.incarnation for s in ranks)
            for rank in ranks:
                rank.incarnation = incarnation
            ready.append(ranks)
        return ready, stuck

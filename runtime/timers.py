"""Timers: the messages an actor scheduled for itself, and its periodic Tick.

Timers are messages, not sleeps: :meth:`Timers.add` queues a message for a monotonic
time, and the driver's loop hands each due one to its handler like any other delivery
(from the actor's own instance, transport seq 0), then sleeps no later than
:meth:`Timers.next_due`. The Tick re-arms itself ``tick_s`` after its due time, skipping
ticks missed while the loop was busy (``late_s`` says by how much it was late), and is
never handed over again: the next one comes anyway.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from ringfence.runtime.mailbox import Delivery
from ringfence.runtime.messages import Tick


class Timers:
    """One actor's due messages, earliest first (a heap; equal times in the order added).

    Owned by the actor's :class:`~ringfence.runtime.driver.Driver` and used from its loop
    thread only, which is also the thread the actor's handlers schedule from.
    """

    def __init__(self, instance: str, tick_s: float | None) -> None:
        self._instance = instance  # the peer a timer's delivery names
        self._tick_s = tick_s  # the actor's tick period; None: it has no tick
        self._heap: list[tuple[float, int, object]] = []  # (due, order added, message)
        self._order = itertools.count()
        self._ticks = 0  # ticks handed out so far

    def add(self, due: float, msg: object) -> None:
        """Queue ``msg`` for monotonic time ``due``."""
        heapq.heappush(self._heap, (due, next(self._order), msg))

    def next_due(self) -> float | None:
        """When the earliest timer is due; None when there is none."""
        return self._heap[0][0] if self._heap else None

    def fire(
        self, now: float, dispatch: Callable[[Delivery], bool], stopped: Callable[[], bool]
    ) -> int:
        """Hand every timer due at ``now`` to ``dispatch`` in order, until ``stopped()``;
        return how many were handed. One ``dispatch`` refused (blocked downstream) ends
        the turn, its message queued again for now (a Tick is not)."""
        fired = 0
        while self._heap and self._heap[0][0] <= now and not stopped():
            due, _, msg = heapq.heappop(self._heap)
            if isinstance(msg, Tick):
                assert self._tick_s is not None, "a Tick fired for an actor without tick_s"
                self._ticks += 1
                msg = Tick(n=self._ticks, late_s=now - due)
                period = self._tick_s
                self.add(due + period if due + period > now else now + period, msg)  # skip missed
            fired += 1
            if not dispatch(Delivery(self._instance, 0, msg, None)):
                if not isinstance(msg, Tick):  # the next tick comes anyway
                    self.add(now, msg)
                break
        return fired

"""The scheduler's queues: every live sequence, waiting or running, found by either id.

Invariants, kept by the :class:`ringfence.sched.scheduler.Scheduler` that owns the queues
(and by the admission path it hands ``waiting`` and ``running`` to, which moves a
sequence from the one to the other):

- a live sequence is in :attr:`Queues.seqs` under its seq id and in :attr:`Queues.by_id`
  under its request id, and in exactly one of ``waiting`` and ``running``; a sequence
  that ended (finished or aborted) is in none of them;
- ``waiting`` is in arrival order (seq ids increase): a new request joins at its end, and
  a sequence taken off the device (preempted, retried, reset) goes back before every
  later arrival, so nobody overtakes it; a sequence whose prefetch runs waits there too;
- ``running`` is in admission order: the newest admitted, the first preempted, is last.

Seq ids are handed out in arrival order and never reused. Pure data: no blocks, no ops;
not thread-safe.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

from ringfence.sched.request import Request
from ringfence.sched.sequence import Sequence


class Queues:
    """The live sequences, by seq id and request id, and the waiting and running queues."""

    def __init__(self) -> None:
        self.seqs: dict[int, Sequence] = {}  # every live sequence, by seq id
        self.by_id: dict[str, Sequence] = {}  # the same, by request id
        self.waiting: deque[Sequence] = deque()  # waiting, prefetching and preempted
        self.running: list[Sequence] = []  # in admission order
        self._next_seq = 0  # the seq id of the next request added

    def add(self, request: Request) -> Sequence:
        """A new sequence for ``request`` (not live yet: the caller checked the id), queued
        at the end of ``waiting``."""
        seq = Sequence(self._next_seq, request)
        self._next_seq += 1
        self.seqs[seq.seq_id] = seq
        self.by_id[request.request_id] = seq
        self.waiting.append(seq)
        return seq

    def leave(self, seq: Sequence) -> None:
        """Take ``seq`` out of whichever queue holds it (it stays findable: see forget)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def forget(self, seq: Sequence) -> None:
        """``seq`` ended: no id finds it any more. Idempotent."""
        self.seqs.pop(seq.seq_id, None)
        self.by_id.pop(seq.request.request_id, None)

    def back_to_waiting(self, seq: Sequence) -> None:
        """Move a running ``seq`` back to ``waiting``, before every later arrival."""
        self.running.remove(seq)
        index = 0
        while index < len(self.waiting) and self.waiting[index].seq_id < seq.seq_id:
            index += 1
        self.waiting.insert(index, seq)

    def newest_running(self, sparing: Collection[int]) -> Sequence | None:
        """The newest admitted running sequence whose seq id is not in ``sparing``; None
        when every one is spared."""
        return next((s for s in reversed(self.running) if s.seq_id not in sparing), None)

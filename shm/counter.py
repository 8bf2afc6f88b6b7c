"""Sequence counters (watermarks): single-writer 8-byte counters in shared memory.

A watermark says "every op numbered <= value is done". It has exactly one writer
(the executor of its lane) and any number of readers. Values only grow, except
that a restarted writer may re-claim the counter and keep its value.

Byte layout of a counter block segment: a 64-byte header line, then one 64-byte
line per counter so two writers never share a cache line.

    header  word 0: magic "RFCOUNT1"   word 1: layout version   word 2: counter count
    line i  word 0: value   word 1: writer pid   word 2: writer start ticks

The value is written with one aligned 8-byte store (see ``Segment.u64``); the
writer's stamp is advisory, read only after a wait timed out to tell a slow
writer from a dead one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from ringfence.shm.doorbell import Doorbell
from ringfence.shm.errors import ActorDead, SegmentLayoutError, WaitTimeout
from ringfence.shm.liveness import ProcessStamp
from ringfence.shm.segment import Segment

MAGIC = int.from_bytes(b"RFCOUNT1", "little")
LAYOUT_VERSION = 1
LINE_WORDS = 8  # 64-byte lines
_H_MAGIC, _H_VERSION, _H_COUNT = 0, 1, 2
_VALUE, _PID, _TICKS = 0, 1, 2


class Waker(Protocol):
    """What a writer rings after an advance: a :class:`Doorbell`, or an in-process waiter."""

    def ring(self) -> None: ...


class CounterBlock:
    """A segment of ``count`` counters. The creator unlinks it; attachers close."""

    def __init__(self, segment: Segment, count: int | None = None) -> None:
        self.segment = segment
        words = segment.u64(0, segment.size // 8)
        if count is not None:
            words[_H_COUNT] = count
            words[_H_VERSION] = LAYOUT_VERSION
            words[_H_MAGIC] = MAGIC
        elif words[_H_MAGIC] != MAGIC or words[_H_VERSION] != LAYOUT_VERSION:
            raise SegmentLayoutError(
                f"{segment.name} is not a ringfence counter block (v{LAYOUT_VERSION})"
            )
        self.count = words[_H_COUNT]
        if segment.size < LINE_WORDS * 8 * (self.count + 1):
            raise SegmentLayoutError(f"{segment.name}: {self.count} counters need a larger segment")
        # One wrapper per counter, kept: claim() stores the notify list on it.
        self._marks = tuple(
            Watermark(words, LINE_WORDS * (i + 1), f"{segment.name}[{i}]")
            for i in range(self.count)
        )

    @classmethod
    def create(cls, name: str, count: int) -> CounterBlock:
        if count <= 0:
            raise ValueError(f"counter block {name}: count must be positive, got {count}")
        seg = Segment.create(name, LINE_WORDS * 8 * (count + 1))
        try:
            return cls(seg, count)
        except BaseException:
            seg.close()
            seg.unlink()
            raise

    @classmethod
    def attach(cls, name: str) -> CounterBlock:
        seg = Segment.attach(name)
        try:
            return cls(seg)
        except BaseException:
            seg.close()
            raise

    def __getitem__(self, index: int) -> Watermark:
        if not 0 <= index < self.count:
            raise IndexError(f"{self.segment.name}: counter {index} of {self.count}")
        return self._marks[index]

    def close(self) -> None:
        self._marks = ()
        self.segment.close()

    def unlink(self) -> None:
        self.segment.unlink()


class Watermark:
    """One counter of a block. ``advance`` is for its single writer; anyone may read or wait.

    ``notify`` lists the doorbells of the processes that may wait on this counter;
    the writer rings each after every advance.
    """

    __slots__ = ("_base", "_words", "name", "notify")

    def __init__(self, words: memoryview, base: int, name: str) -> None:
        self._words = words
        self._base = base
        self.name = name
        self.notify: tuple[Waker, ...] = ()

    def value(self) -> int:
        return int(self._words[self._base + _VALUE])

    def claim(self, notify: Iterable[Waker] = ()) -> None:
        """Become the writer: record this process's stamp and whom to ring on advance."""
        stamp = ProcessStamp.current()
        self._words[self._base + _TICKS] = stamp.start_ticks
        self._words[self._base + _PID] = stamp.pid
        self.notify = tuple(notify)

    def advance(self, to: int) -> None:
        """Publish that every op <= ``to`` is done. Values never go backwards."""
        current = self._words[self._base + _VALUE]
        if to < current:
            raise ValueError(f"watermark {self.name} cannot go back from {current} to {to}")
        if to != current:
            self._words[self._base + _VALUE] = to
            for bell in self.notify:
                bell.ring()

    def writer(self) -> ProcessStamp | None:
        pid = self._words[self._base + _PID]
        if not pid:
            return None
        return ProcessStamp(pid=pid, start_ticks=self._words[self._base + _TICKS])

    def writer_gone(self) -> bool:
        """Whether a writer claimed this watermark and its process is gone: the value will
        not advance until another claims it."""
        writer = self.writer()
        return writer is not None and not writer.is_alive()

    def wait_for(self, target: int, timeout: float, bell: Doorbell) -> int:
        """Wait until the value reaches ``target``, sleeping on the caller's own ``bell``.

        Returns the value seen. Raises :class:`WaitTimeout` at the deadline, or
        :class:`ActorDead` if by then the writer's process is gone.
        """
        words, slot = self._words, self._base + _VALUE
        if not bell.wait_until(lambda: words[slot] >= target, timeout):
            raise self.overdue(target, f"in {timeout}s")
        return int(words[slot])

    def overdue(self, target: int, detail: str = "") -> ActorDead | WaitTimeout:
        """The error for a wait on ``target`` that ran out of time: ActorDead if the
        writer's process is gone (it will never get there), else WaitTimeout."""
        writer = self.writer()
        if writer is not None and not writer.is_alive():
            return ActorDead(
                f"watermark {self.name}: writer pid {writer.pid} is gone "
                f"at {self.value()} < {target}"
            )
        suffix = f" {detail}" if detail else ""
        return WaitTimeout(
            f"watermark {self.name} at {self.value()} did not reach {target}{suffix}"
        )


def wait_or_gone(
    marks: Sequence[Watermark],
    target: int,
    *,
    timeout: float,
    wait: Callable[[Callable[[], bool], float], bool],
    look_every: float,
) -> list[Watermark]:
    """Wait until every watermark of ``marks`` reaches ``target``, or until each one short of
    it has a writer that is gone (it will not advance), or ``timeout`` seconds pass; the ones
    still short (empty: all reached). ``wait(ready, seconds)`` sleeps on the caller's doorbell,
    which a live writer rings as it advances; a writer that dies rings nothing, so the wait
    wakes every ``look_every`` seconds to look at the writers."""
    deadline = time.monotonic() + timeout
    while short := [m for m in marks if m.value() < target]:
        left = deadline - time.monotonic()
        if left <= 0 or all(m.writer_gone() for m in short):
            return short
        wait(lambda: all(m.value() >= target for m in marks), min(left, look_every))
    return []

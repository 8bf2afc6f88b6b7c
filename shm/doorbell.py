"""Doorbells: one semaphore per consumer, with an eventcount so idle handoffs skip the syscall.

A consumer waits for *a condition* (a ring has a frame, a watermark reached a
value), never for a post: posts are hints and the shared state is the truth. The
wait is spin-briefly-then-block:

1. spin: re-check the condition, yielding the CPU between checks, for at most the
   current spin window;
2. arm: store ``sleeping = 1``, full barrier, re-check the condition;
3. block on the semaphore until the deadline, then disarm and re-check.

A producer publishes its state, issues a full barrier, and posts only if it sees
the consumer armed. The two barriers make the Dekker pattern safe: either the
consumer's re-check sees the new state, or the producer sees the flag and posts.
A post that arrives after the consumer already saw the state leaves a stale count
behind; it only costs one extra empty round of the wait loop.

One post per sleep: the flag is not 1 but the arming's *generation* (1, 2, 3, ...,
a new one every time the consumer arms), and each producer handle remembers the
generation it last posted for. A producer that publishes many frames to a consumer
that has not yet run (the two share a CPU, or the consumer is being woken) posts for
the first and skips the semaphore, a system call, for the rest: that one post wakes
this arming, and the consumer arms again only with a new generation. Every arming
takes a new generation, so a producer never skips for an arming it has not posted
to (a consumer woken for one condition that waits again for another included).

The spin window adapts: a spin that catches the condition keeps the window; a spin
that fails halves it, down to pure blocking. When the peer shares our CPU (or a
third process does), handoffs keep overrunning any window and spinning only steals
the CPU the peer needs, so the window collapses to zero. Every 64th blocking wait
probes with a full window again, so the policy recovers when placement changes.

Byte layout of the doorbell's segment (``/rf-<run>-<name>``; the semaphore has the
same name in the semaphore namespace): u64 ``sleeping`` at offset 0 (0, or the
generation of the current arming) and u64 ``generation`` at offset 8 (the last one
taken, so a restarted waiter goes on from it), both written by the waiter only;
padded to 64 bytes so they share no cache line with anything else.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable

import posix_ipc

from ringfence.shm.barrier import TSO, barrier_enter, barrier_leave, full_barrier
from ringfence.shm.errors import NameExists, NameMissing
from ringfence.shm.segment import Segment

SEGMENT_BYTES = 64
_SLEEPING, _GENERATION = 0, 1  # indexes of the u64 words written by the waiter
DEFAULT_SPIN_US = 50.0
_PROBE_EVERY = 64
_MIN_WINDOW_NS = 2_000


class SpinPolicy:
    """The adaptive spin window of one waiter (process-local, not shared)."""

    __slots__ = ("blocked_waits", "max_ns", "window_ns")

    def __init__(self, spin_us: float) -> None:
        if spin_us < 0:
            raise ValueError(f"runtime.spin_us must be >= 0, got {spin_us}")
        self.max_ns = int(spin_us * 1000)
        self.window_ns = self.max_ns
        self.blocked_waits = 0

    def next_window(self) -> int:
        """The spin budget in nanoseconds for the next wait."""
        if (
            self.window_ns == 0
            and self.max_ns
            and self.blocked_waits % _PROBE_EVERY == _PROBE_EVERY - 1
        ):
            return self.max_ns
        return self.window_ns

    def spun_and_caught(self, window_ns: int) -> None:
        self.window_ns = max(self.window_ns, window_ns)

    def spun_and_missed(self) -> None:
        self.blocked_waits += 1
        half = self.window_ns // 2
        self.window_ns = half if half >= _MIN_WINDOW_NS else 0


class Doorbell:
    """A consumer's wake-up semaphore plus its eventcount flag.

    Exactly one thread waits on a doorbell at a time (its consumer); any number of
    producers may ring it. The creator unlinks both names; attachers only close.
    """

    _sem: posix_ipc.Semaphore | None = None
    _seg: Segment | None = None

    def __init__(
        self, name: str, *, create: bool = False, spin_us: float = DEFAULT_SPIN_US
    ) -> None:
        self.name = name
        self.is_creator = create
        self.spin = SpinPolicy(spin_us)
        if create:
            try:
                self._sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
            except posix_ipc.ExistentialError as e:
                raise NameExists(f"doorbell semaphore {name} already exists") from e
        else:
            try:
                self._sem = posix_ipc.Semaphore(name)
            except posix_ipc.ExistentialError as e:
                raise NameMissing(f"doorbell semaphore {name} does not exist") from e
        try:
            self._seg = Segment(name, size=SEGMENT_BYTES, create=create)
        except BaseException:
            self.close()
            if create:
                self.unlink()
            raise
        self._word = self._seg.u64(0, 2)
        self._posted = 0  # the arming this handle last posted for (producer side)

    @classmethod
    def create(cls, name: str, *, spin_us: float = DEFAULT_SPIN_US) -> Doorbell:
        return cls(name, create=True, spin_us=spin_us)

    @classmethod
    def attach(cls, name: str, *, spin_us: float = DEFAULT_SPIN_US) -> Doorbell:
        return cls(name, spin_us=spin_us)

    def ring(self) -> None:
        """Producer side: call after publishing new state. Posts only if the consumer may sleep."""
        barrier_enter()  # full_barrier(), inline: this runs once per published frame
        barrier_leave()
        armed = self._word[_SLEEPING]
        if (armed and armed != self._posted) or not TSO:
            self._posted = armed
            assert self._sem is not None
            self._sem.release()

    def wait_until(self, ready: Callable[[], bool], timeout: float) -> bool:
        """Consumer side: wait until ``ready()`` is true; False if ``timeout`` seconds pass first.

        ``ready`` must only read shared state; it is called many times.
        """
        if ready():
            return True
        deadline = time.monotonic() + timeout
        window = self.spin.next_window()
        if window:
            end = time.perf_counter_ns() + window
            while time.perf_counter_ns() < end:
                os.sched_yield()
                if ready():
                    self.spin.spun_and_caught(window)
                    return True
            self.spin.spun_and_missed()
        else:
            self.spin.blocked_waits += 1
        return self._block_until(ready, deadline)

    def _block_until(self, ready: Callable[[], bool], deadline: float) -> bool:
        sem, word = self._sem, self._word
        assert sem is not None
        while True:
            generation = word[_GENERATION] + 1
            word[_GENERATION] = generation
            word[_SLEEPING] = generation
            full_barrier()
            if ready():
                word[_SLEEPING] = 0
                return True
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                word[_SLEEPING] = 0
                return False
            try:
                sem.acquire(remaining)
            except posix_ipc.BusyError:
                word[_SLEEPING] = 0
                return ready()
            except posix_ipc.SignalError:
                # A signal handler ran (sem_wait is never restarted): its effect may be
                # what ``ready`` looks for, so re-check like any other wake-up.
                pass
            word[_SLEEPING] = 0
            if ready():
                return True
            # A stale post from a producer that raced our last re-check: go round again.

    def close(self) -> None:
        """Release this process's handles. Idempotent; safe on a half-built doorbell."""
        sem, self._sem = self._sem, None
        if sem is not None:
            sem.close()
        if self._seg is not None:
            self._seg.close()

    def unlink(self) -> None:
        """Remove both names (creator only). Idempotent."""
        if not self.is_creator:
            return
        for unlink in (posix_ipc.unlink_semaphore, posix_ipc.unlink_shared_memory):
            with contextlib.suppress(posix_ipc.ExistentialError):
                unlink(self.name)
        if self._seg is not None:
            self._seg.unlink()

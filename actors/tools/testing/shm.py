"""Test helpers for ``ringfence.shm``: builders for rings and doorbells, and leak checks.

Used by ringfence's own tests and by anyone embedding ringfence who wants the same
guarantees in theirs (no shared-memory name left behind).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from ringfence.shm import names
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.ring import Ring
from ringfence.shm.ring_reader import RingReader
from ringfence.shm.ring_writer import RingWriter


def shm_names() -> set[str]:
    """Every ringfence file in /dev/shm (segments and semaphores), by file name."""
    return {e.file for e in names.list_names()}


def leaked_names(before: set[str]) -> list[names.ShmEntry]:
    """Names of runs issued by this process that exist now but were not in ``before``."""
    return [
        e for e in names.list_names() if e.run_id in names.ISSUED_RUN_IDS and e.file not in before
    ]


@dataclass(frozen=True, slots=True)
class RingPair:
    """A ring with both endpoints open in this process, and the doorbells behind them."""

    run_id: str
    ring: Ring
    writer: RingWriter
    reader: RingReader
    producer_bell: Doorbell  # the producer's own bell (space)
    consumer_bell: Doorbell  # the consumer's own bell (wake)


@contextmanager
def ring_pair(
    capacity: int = 4096, *, spin_us: float = 50.0, run_id: str | None = None
) -> Iterator[RingPair]:
    """Create a ring and two doorbells; close and unlink all of them on exit."""
    run_id = run_id or names.new_run_id()
    with ExitStack() as stack:
        ring = Ring.create(names.posix_name(run_id, "ring"), capacity)
        stack.callback(ring.unlink)
        stack.callback(ring.close)
        bells = []
        for obj in ("producer", "consumer"):
            bell = Doorbell.create(names.posix_name(run_id, obj), spin_us=spin_us)
            stack.callback(bell.unlink)
            stack.callback(bell.close)
            bells.append(bell)
        producer_bell, consumer_bell = bells
        writer = RingWriter(ring, wake=consumer_bell, space=producer_bell)
        reader = RingReader(ring, bell=consumer_bell, space=producer_bell)
        yield RingPair(run_id, ring, writer, reader, producer_bell, consumer_bell)


class _Child(Protocol):
    pid: int | None

    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...


def reap(proc: _Child, timeout: float = 5.0) -> None:
    """End a child this test started, by its own pid, if it still runs; then join it."""
    if proc.is_alive() and proc.pid is not None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout)


def reap_subprocess(proc: subprocess.Popen[Any], timeout: float = 5.0) -> int:
    """As :func:`reap`, for a ``subprocess.Popen``: SIGKILL by pid if it still runs, wait for
    it, close its pipes. Returns its exit status."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    status = proc.wait(timeout)
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()
    return status

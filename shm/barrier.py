"""A full memory barrier, callable from Python.

The doorbell's eventcount is a Dekker pattern: the consumer stores "I am going to
sleep" and then loads the ring head; the producer stores the ring head and then
loads the flag. x86-64 may reorder a store with a later load, so both sides need a
full barrier between the two, or a wake-up can be lost. CPython has no fence
primitive, but an uncontended ``threading.Lock`` acquire and release are locked
read-modify-write instructions (``lock cmpxchg`` / ``lock xadd`` through
``sem_trywait``/``sem_post`` or ``PyMutex``), and every locked instruction is a
full barrier on x86-64.

On other architectures those instructions only have acquire/release strength, so
``TSO`` is False there and callers must not rely on a skipped post: the doorbell
then posts on every ring.
"""

from __future__ import annotations

import platform
import threading

TSO = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")

_lock = threading.Lock()
# Bound once: hot paths (a ring's publish and commit) call these two directly, in this
# order, instead of full_barrier(), saving a Python call per frame.
barrier_enter, barrier_leave = _lock.acquire, _lock.release


def full_barrier() -> None:
    """Order every earlier load and store before every later one (on x86-64)."""
    barrier_enter()
    barrier_leave()

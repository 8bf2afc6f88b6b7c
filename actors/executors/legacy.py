"""The legacy design's inter-process lock, kept as a baseline to measure (``transfer.mode =
lock``): the Worker holds it around each step and each Transfer lane around each copy and
storage op, as the legacy server's IPC lock around model execution and swaps and its
storage lock did.

It is a baseline, not a way to order anything: a lock excludes, it does not order, so
in lock mode the ops still carry their fences and wait on them as in ``fence`` mode (a
lock alone let a swap-out run before the step that writes its block: the legacy NaN).
What the mode adds is the exclusion, and its cost is what ``ringfence bench e2e``
measures: a copy never overlaps a step.

The lock is ``flock`` on one file per rank in the run dir, so the kernel releases it
when its holder dies (a killed Worker never hangs the lanes). A blocking ``flock`` has
no deadline, so a contended acquire is handed to a helper thread and waited for with
one; an uncontended one takes the lock in the caller's thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path


class LockTimeout(TimeoutError):
    """The legacy lock was not acquired within its deadline."""


class LegacyLock:
    """One rank's run-wide exclusive lock (see the module doc). Not reentrant; one
    holder per process at a time (each actor process holds its own instance)."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._cond = threading.Condition()
        self._wanted = 0  # acquires asked of the helper thread
        self._granted = 0  # acquires it completed
        self._abandoned = 0  # granted acquires whose waiter had given up: released at once
        self._helper: threading.Thread | None = None
        self._blocked = False  # the helper is in a blocking flock
        self._closed = False
        self.waits = 0  # acquires that found the lock held
        self.wait_ns = 0  # time spent waiting for it

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock for the block; LockTimeout past ``timeout_s``."""
        self.acquire()
        try:
            yield
        finally:
            self.release()

    def acquire(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        started = time.perf_counter_ns()
        self.waits += 1
        with self._cond:
            if self._helper is None:
                self._helper = threading.Thread(
                    target=self._serve, name=f"legacy-lock {self.path.name}", daemon=True
                )
                self._helper.start()
            self._wanted += 1
            ticket = self._wanted
            self._cond.notify_all()
            got = self._cond.wait_for(lambda: self._granted >= ticket, self.timeout_s)
            if not got:
                self._abandoned += 1
        self.wait_ns += time.perf_counter_ns() - started
        if not got:
            raise LockTimeout(
                f"the legacy lock {self.path} was not acquired in {self.timeout_s:g} s"
            )

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _serve(self) -> None:
        """The helper thread: take the lock for each contended acquire, in order; hand it
        over, or drop it when its waiter has given up. It ends when closed or idle for
        ``timeout_s`` (the next contended acquire starts another)."""
        while True:
            with self._cond:
                work = self._cond.wait_for(
                    lambda: self._closed or self._wanted > self._granted, self.timeout_s
                )
                if self._closed or not work:
                    self._helper = None
                    return
                self._blocked = True
            fcntl.flock(self._fd, fcntl.LOCK_EX)  # the lock is the process's, not the thread's
            with self._cond:
                self._blocked = False
                if self.closed:  # closed while this thread waited: the fd is its to close
                    self._helper = None
                    os.close(self._fd)
                    return
                self._granted += 1
                if self._abandoned:
                    self._abandoned -= 1
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Idempotent. A helper thread blocked in ``flock`` closes the file once it returns."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            if self._blocked:
                return
        os.close(self._fd)


def lock_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"legacy-{rank}.lock"

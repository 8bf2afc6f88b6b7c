"""Turns file-descriptor events (child exits, signals) into rings of the supervisor's doorbell.

The supervisor sleeps on one doorbell (a semaphore), which cannot wait on file
descriptors. A child's exit shows as its process sentinel becoming readable, and
a signal as a byte on the ``signal.set_wakeup_fd`` pipe; this thread selects on
both and rings the doorbell. It also records the signal numbers itself, so the
supervisor never depends on when the interpreter gets round to running the
Python-level handler (those handlers are no-ops that only stop the default action).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import threading
from collections.abc import Iterable
from types import FrameType

from ringfence.runtime.mailbox import Waiter

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_SELECT_DEADLINE_S = 30.0  # a blocking wait always has a deadline; waking idle costs nothing


def _ignore(_signum: int, _frame: FrameType | None) -> None:
    """Replaces the default action; the waker thread reports the signal."""


class Waker:
    """Owned by the supervisor's main thread, which alone calls every method but ``run``."""

    def __init__(self, bell: Waiter) -> None:
        self._bell = bell
        self._lock = threading.Lock()
        self._signals: list[int] = []
        self._exited: set[int] = set()  # sentinels that became readable, not yet collected
        self._watched: set[int] = set()
        self._signal_r, self._signal_w = os.pipe()
        self._ctl_r, self._ctl_w = os.pipe()
        for fd in (self._signal_r, self._signal_w, self._ctl_r, self._ctl_w):
            os.set_blocking(fd, False)
        self._closing = False
        self._previous: dict[int, object] = {}
        self._old_wakeup_fd: int | None = None
        self._thread = threading.Thread(target=self._run, name="ringfence-waker", daemon=True)

    def start(self) -> None:
        """Install the wake-up fd and no-op handlers (main thread only), start the thread."""
        self._old_wakeup_fd = signal.set_wakeup_fd(self._signal_w, warn_on_full_buffer=False)
        for signum in HANDLED_SIGNALS:
            self._previous[signum] = signal.signal(signum, _ignore)
        self._thread.start()

    def watch(self, sentinels: Iterable[int]) -> None:
        """Add process sentinels to wait on."""
        with self._lock:
            self._watched.update(sentinels)
        self._poke()

    def take(self) -> tuple[list[int], set[int]]:
        """The signals received and sentinels that fired since the last call."""
        with self._lock:
            signals, self._signals = self._signals, []
            exited, self._exited = self._exited, set()
        return signals, exited

    @property
    def pending(self) -> bool:
        return bool(self._signals or self._exited)

    def close(self) -> None:
        """Stop the thread, restore the previous handlers and wake-up fd. Idempotent."""
        if self._closing:
            return
        self._closing = True
        self._poke()
        if self._thread.is_alive():
            self._thread.join(5.0)
        if self._old_wakeup_fd is not None:
            signal.set_wakeup_fd(self._old_wakeup_fd)
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        for fd in (self._signal_r, self._signal_w, self._ctl_r, self._ctl_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _poke(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._ctl_w, b"\0")

    def _run(self) -> None:
        with selectors.DefaultSelector() as selector:
            selector.register(self._signal_r, selectors.EVENT_READ)
            selector.register(self._ctl_r, selectors.EVENT_READ)
            registered: set[int] = set()
            while not self._closing:
                with self._lock:
                    for fd in self._watched - registered:
                        selector.register(fd, selectors.EVENT_READ)
                        registered.add(fd)
                fired = False
                for key, _ in selector.select(_SELECT_DEADLINE_S):
                    fd = int(key.fd)
                    if fd == self._ctl_r:
                        _drain(fd)
                    elif fd == self._signal_r:
                        with self._lock:
                            self._signals.extend(_drain(fd))
                        fired = True
                    else:  # a child exited: its sentinel stays readable, so stop watching it
                        selector.unregister(fd)
                        registered.discard(fd)
                        with self._lock:
                            self._watched.discard(fd)
                            self._exited.add(fd)
                        fired = True
                if fired:
                    self._bell.ring()


def _drain(fd: int) -> bytes:
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 512):
            data += chunk
    return data

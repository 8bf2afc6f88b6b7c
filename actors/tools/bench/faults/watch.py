"""Sleeping until another process tree writes a file or exits: inotify and a pidfd.

A launched run publishes its progress only in files (its logs, ``actors.json``, a marker a
client writes); inotify turns a write into a readable descriptor, and a pidfd turns the
launch's exit into one, so the fault runner blocks in one ``select`` with a deadline
instead of re-reading files on a timer. Linux only, as the rest of the runtime.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
from collections.abc import Sequence
from pathlib import Path

# <sys/inotify.h>: a file written, created, or renamed into a watched folder.
IN_MODIFY, IN_MOVED_TO, IN_CREATE = 0x2, 0x80, 0x100
_READ_BYTES = 1 << 16


def _libc_call(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


class FolderWatch:
    """Wakes :meth:`wait` when a file in one of ``folders`` is written, created or renamed
    into it, or when process ``pid`` exits (for good: every later wait returns at once).

    Owner: one thread. :meth:`close` releases both descriptors; idempotent.
    """

    def __init__(self, folders: Sequence[Path], pid: int) -> None:
        self._fds: list[int] = []
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            flags = os.O_NONBLOCK | os.O_CLOEXEC
            self._inotify = _libc_call(libc.inotify_init1(flags), "inotify_init1")
            self._fds.append(self._inotify)
            for folder in folders:
                mask = IN_MODIFY | IN_MOVED_TO | IN_CREATE
                watch = libc.inotify_add_watch(self._inotify, os.fsencode(folder), mask)
                _libc_call(watch, f"inotify_add_watch {folder}")
            self._fds.append(os.pidfd_open(pid))
        except BaseException:
            self.close()
            raise

    def wait(self, timeout: float) -> None:
        """Until something changed or ``timeout`` seconds passed; takes in what woke it, so
        the next wait sleeps until the next change."""
        ready, _, _ = select.select(self._fds, [], [], max(0.0, timeout))
        if self._inotify in ready:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._inotify, _READ_BYTES):
                    pass

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)

"""The legacy lock of ``transfer.mode = lock`` (a baseline): it excludes across processes,
its holder's death releases it, every wait for it has a deadline, and closing it leaks no
file descriptor even while its helper thread is blocked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ringfence.actors.executors.legacy import LegacyLock, LockTimeout, lock_path

HOLD = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.readline()  # hold until told, or killed
"""


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def holder(tmp_path: Path):
    """A child process holding the rank-0 lock of ``tmp_path`` until it is ended."""
    path = lock_path(tmp_path, 0)
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "held\n"
        yield child
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(10)


def test_an_uncontended_lock_is_taken_in_the_callers_thread_and_excludes_another(tmp_path):
    a = LegacyLock(lock_path(tmp_path, 0), timeout_s=0.2)
    b = LegacyLock(lock_path(tmp_path, 0), timeout_s=0.2)
    try:
        with a.held():
            assert a.waits == 0
            with pytest.raises(LockTimeout, match=r"legacy-0\.lock"):
                b.acquire()
        with b.held():  # free again: taken at once
            pass
        assert b.waits == 1 and b.wait_ns >= 0.2e9
    finally:
        a.close()
        b.close()


def test_another_ranks_lock_is_another_lock(tmp_path):
    a = LegacyLock(lock_path(tmp_path, 0), timeout_s=0.2)
    b = LegacyLock(lock_path(tmp_path, 1), timeout_s=0.2)
    try:
        with a.held(), b.held():
            assert (a.waits, b.waits) == (0, 0)
    finally:
        a.close()
        b.close()


def test_a_holder_killed_with_the_lock_releases_it_and_the_waiter_goes_on(tmp_path, holder):
    lock = LegacyLock(lock_path(tmp_path, 0), timeout_s=10.0)
    killer = threading.Timer(0.3, lambda: os.kill(holder.pid, signal.SIGKILL))
    killer.start()
    try:
        started = time.monotonic()
        with lock.held():
            assert time.monotonic() - started >= 0.25  # it waited for the holder to die
        assert lock.waits == 1
    finally:
        killer.join(10)
        lock.close()


def test_a_waiter_that_gave_up_does_not_keep_the_lock_its_helper_takes_later(tmp_path, holder):
    lock = LegacyLock(lock_path(tmp_path, 0), timeout_s=0.2)
    other = LegacyLock(lock_path(tmp_path, 0), timeout_s=5.0)
    try:
        with pytest.raises(LockTimeout):
            lock.acquire()
        assert holder.stdin is not None
        holder.stdin.write("release\n")
        holder.stdin.flush()
        holder.wait(10)
        # lock's helper takes the lock once the holder leaves and drops it at once.
        with other.held():
            pass
        with lock.held():  # and lock itself works again
            pass
    finally:
        lock.close()
        other.close()


def test_closing_while_the_helper_is_blocked_leaks_no_file_descriptor(tmp_path, holder):
    before = open_fds()
    lock = LegacyLock(lock_path(tmp_path, 0), timeout_s=0.2)
    with pytest.raises(LockTimeout):
        lock.acquire()  # its helper now blocks in flock until the holder leaves
    helper = lock._helper
    assert helper is not None and helper.is_alive()
    lock.close()
    assert open_fds() == before + 1  # the helper holds it until flock returns
    holder.kill()
    helper.join(10)
    assert not helper.is_alive()
    assert open_fds() == before

"""The fault runner's wait: a write in a watched folder or the launch's exit wakes it."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ringfence.actors.tools.bench.faults.watch import FolderWatch


@pytest.fixture
def child():
    """A process that lives until its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    yield proc
    if proc.stdin is not None:
        proc.stdin.close()
    proc.wait(10)


def timed_wait(watch: FolderWatch, timeout: float) -> float:
    began = time.monotonic()
    watch.wait(timeout)
    return time.monotonic() - began


def test_a_quiet_folder_sleeps_until_the_timeout(tmp_path: Path, child) -> None:
    watch = FolderWatch([tmp_path], child.pid)
    try:
        assert timed_wait(watch, 0.2) >= 0.19
    finally:
        watch.close()
        watch.close()  # idempotent


@pytest.mark.parametrize("folder", ["first", "second"])
def test_a_file_written_in_any_watched_folder_wakes_the_wait_and_is_taken_in(
    tmp_path: Path, child, folder: str
) -> None:
    folders = {name: tmp_path / name for name in ("first", "second")}
    for path in folders.values():
        path.mkdir()
    watch = FolderWatch(list(folders.values()), child.pid)
    try:
        writer = threading.Timer(0.05, (folders[folder] / "log.jsonl").write_bytes, (b"{}\n",))
        writer.start()
        assert timed_wait(watch, 10) < 5
        writer.join()
        # Taken in: once the write's few events (create, modify) are read, the wait sleeps
        # again; a watch that left them unread would return at once every time.
        assert any(timed_wait(watch, 0.2) >= 0.19 for _ in range(3))
    finally:
        watch.close()


def test_the_process_exiting_wakes_the_wait(tmp_path: Path, child) -> None:
    watch = FolderWatch([tmp_path], child.pid)
    try:
        assert child.stdin is not None
        threading.Timer(0.05, child.stdin.close).start()
        assert timed_wait(watch, 10) < 5
        child.wait(10)
        assert timed_wait(watch, 10) < 1  # for good
    finally:
        watch.close()


def test_a_missing_folder_is_an_os_error_naming_it(tmp_path: Path, child) -> None:
    with pytest.raises(OSError, match=r"inotify_add_watch .*nowhere"):
        FolderWatch([tmp_path / "nowhere"], child.pid)

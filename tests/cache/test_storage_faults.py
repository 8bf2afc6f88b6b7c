"""Storage faults, backend by backend: a guarded presence never raises, a stopped or hung
redis fails at once or after its timeout and is found again after a restart, and a
local directory that is full or unreadable gives failed puts and misses, never data.

Whole runs under the same faults are in test_storage_runs.py. The last two tests check
that the engine and the store lane hand their storage clients the log and the timeout.
"""

from __future__ import annotations

import ast
import errno
import hashlib
import inspect
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import closing
from pathlib import Path
from types import ModuleType
from typing import cast

import pytest
from mounts import MOUNT_TIMEOUT_S, mounted_tmpfs

from ringfence.actors.config import Config
from ringfence.actors.engine.storage import open_all_ranks
from ringfence.actors.model.info import ModelInfo
from ringfence.actors.tools.testing.redis_server import (
    REDIS_SERVER,
    free_port,
    redis_server,
    url_port,
)
from ringfence.actors.tools.testing.storage import RecordingLog
from ringfence.cache.config import StorageConfig
from ringfence.cache.ids import BlockHash
from ringfence.cache.storage import (
    StorageBackend,
    StorageUnavailable,
    StorageWriteFailed,
)
from ringfence.cache.storage.blob import TRAILER, decode
from ringfence.cache.storage.blob_files import BlobFiles
from ringfence.cache.storage.blob_index import TMP_PREFIX
from ringfence.cache.storage.guarded import GuardedBackend
from ringfence.cache.storage.local import LocalBackend
from ringfence.cache.storage.memory import MemoryBackend
from ringfence.cache.storage.redis_backend import RedisBackend
from ringfence.cache.storage.registry import BACKENDS, Backend, Place, open_backend, open_storage
from ringfence.shm.errors import ConfigError

FP = hashlib.blake2b(b"model-a", digest_size=16).digest()
BLOCK = 16384  # a tiny-preset float64 block at block size 16
BLOB = BLOCK + TRAILER.size
FAST_S = 0.5  # "at once": well under any timeout, well over a refused connect


def key(i: int) -> BlockHash:
    return BlockHash(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest())


def payload(i: int, size: int = BLOCK) -> bytes:
    return bytes((i + j) % 251 for j in range(size))


def items(*numbers: int) -> list[tuple[BlockHash, bytes]]:
    return [(key(i), payload(i)) for i in numbers]


def temp_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob(f"{TMP_PREFIX}*"))


def needs_redis() -> None:
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")


# --- the guarded presence -------------------------------------------------------------------


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Flaky(MemoryBackend):
    """A memory backend whose presence questions raise ``error`` while it is set."""

    def __init__(self) -> None:
        super().__init__(fingerprint=FP)
        self.error: Exception | None = None
        self.asked = 0  # presence questions that reached it

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        self.asked += 1
        if self.error is not None:
            raise self.error
        return super().longest_prefix(keys)


def make_guarded(**kwargs) -> tuple[GuardedBackend, Flaky, Clock, RecordingLog]:
    backend, clock, log = Flaky(), Clock(), RecordingLog()
    backend.put_many(items(0, 1))
    guarded = GuardedBackend(backend, log=log, clock=clock, **kwargs)
    return guarded, backend, clock, log


def test_a_reachable_backend_answers_through_the_guard():
    guarded, backend, _, log = make_guarded()
    assert guarded.longest_prefix([key(0), key(1), key(2)]) == 2
    assert guarded.available and backend.asked == 1 and log.lines == []


@pytest.mark.parametrize(
    "error",
    [StorageUnavailable("redis at 127.0.0.1:1: refused"), OSError(errno.EIO, "I/O error")],
    ids=["unavailable", "os-error"],
)
def test_an_unreachable_backend_answers_nothing_stored_and_is_logged_once_per_outage(error):
    guarded, backend, clock, log = make_guarded(backoff_s=0.5)
    backend.error = error
    answers = []
    for _ in range(5):
        answers.append(guarded.longest_prefix([key(0), key(1)]))
        clock.now += 0.1  # all within the first back-off
    assert answers == [0] * 5
    assert backend.asked == 1  # the backend was left alone during the back-off
    assert not guarded.available
    fields = {"backend": "memory", "error": str(error), "retry_s": 0.5}
    assert log.lines == [("warning", "storage.unavailable", fields)]


def test_the_backend_is_asked_again_after_each_back_off_which_doubles_up_to_its_cap():
    guarded, backend, clock, log = make_guarded(backoff_s=0.5, backoff_max_s=2.0)
    backend.error = StorageUnavailable("down")
    asked_at = []
    start = clock.now
    while clock.now < start + 8.0:
        before = backend.asked
        guarded.longest_prefix([key(0)])
        if backend.asked > before:
            asked_at.append(round(clock.now - start, 2))
        clock.now += 0.25
    # Retries after 0.5, then 1.0, then 2.0 s (the cap), and 2.0 s from then on.
    assert asked_at == [0.0, 0.5, 1.5, 3.5, 5.5, 7.5]
    assert len(log.events("storage.unavailable")) == 1


def test_the_first_answer_after_an_outage_ends_it_and_the_back_off_starts_over():
    guarded, backend, clock, log = make_guarded(backoff_s=0.5)
    backend.error = StorageUnavailable("down")
    guarded.longest_prefix([key(0)])
    clock.now += 0.5
    guarded.longest_prefix([key(0)])  # the retry fails too: 2 failures
    backend.error = None
    clock.now += 1.0
    assert guarded.longest_prefix([key(0), key(1)]) == 2
    assert guarded.available
    assert log.events("storage.restored") == [{"backend": "memory", "outage_s": 1.5, "failures": 2}]
    # A new outage is logged again and backs off from the first delay.
    backend.error = StorageUnavailable("down again")
    assert guarded.longest_prefix([key(0)]) == 0
    clock.now += 0.5
    asked = backend.asked
    guarded.longest_prefix([key(0)])
    assert backend.asked == asked + 1
    assert [f["error"] for f in log.events("storage.unavailable")] == ["down", "down again"]


def test_a_question_that_waited_out_a_timeout_backs_off_from_when_it_failed():
    guarded, backend, clock, _ = make_guarded(backoff_s=0.5)

    def hung(keys: Sequence[BlockHash]) -> int:
        backend.asked += 1
        clock.now += 2.0  # the backend's timeout passed inside the call
        raise StorageUnavailable("Timeout reading from socket")

    backend.longest_prefix = hung  # type: ignore[method-assign]
    guarded.longest_prefix([key(0)])
    clock.now += 0.25
    guarded.longest_prefix([key(0)])
    assert backend.asked == 1


def test_a_caller_error_still_raises_through_the_guard():
    guarded, _, _, log = make_guarded()
    with pytest.raises(ValueError, match="16 bytes"):
        guarded.longest_prefix([b"short"])  # type: ignore[list-item]
    assert guarded.available and log.lines == []


def test_the_guard_passes_every_other_call_to_its_backend_unchanged():
    guarded, backend, _, _ = make_guarded()
    assert guarded.name == "memory"
    assert guarded.put_many(items(2)) == 1
    assert guarded.get_many([key(2), key(9)]) == [payload(2), None]
    buffer = bytearray(BLOCK)
    assert guarded.get_into([(key(1), buffer)]) == [True] and bytes(buffer) == payload(1)
    assert guarded.delete([key(2)]) == 1
    assert guarded.stats() == backend.stats()
    guarded.close()
    with pytest.raises(ValueError, match="closed"):
        backend.put_many(items(3))


def test_the_engine_gets_a_guarded_client_of_all_ranks_and_none_without_a_tier(tmp_path):
    model = ModelInfo(
        model_id="preset-tiny-seed0",
        vocab_size=259,
        max_position=2048,
        dtype="float32",
        bos_token_id=None,
        eos_token_id=None,
    )
    config = Config.load(None, ["cache.storage.backend=local"])
    storage = open_all_ranks(config, model, str(tmp_path))
    assert storage is not None
    (client,) = storage.ranks  # tp_size 1: one rank's client
    assert isinstance(client, GuardedBackend) and isinstance(client.backend, LocalBackend)
    assert client.answer_s == config.cache.storage.presence_timeout_s == 0.05
    assert client.backend.root == str(tmp_path / "storage")
    storage.close()
    none = Config.load(None, ["cache.storage.backend=none"])
    assert open_all_ranks(none, model, str(tmp_path)) is None


# --- redis: stopped, hung, restarted --------------------------------------------------------


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A URL whose port accepts connections (the kernel's backlog) and never answers."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"


def test_a_redis_server_that_never_answers_fails_after_the_timeout_not_after_retries(
    silent_server,
):
    pytest.importorskip("redis")
    start = time.monotonic()
    with pytest.raises(StorageUnavailable, match="Timeout"):
        open_backend("redis", fingerprint=FP, url=silent_server, timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 0.3 + FAST_S  # one timeout, no retry


def test_the_redis_timeout_setting_must_be_positive():
    with pytest.raises(ConfigError, match=r"^cache\.storage\.timeout_s: must be > 0"):
        open_backend("redis", fingerprint=FP, url="redis://127.0.0.1:1/0", timeout_s=0)
    with pytest.raises(ConfigError, match=r"cache\.storage\.timeout_s: must be > 0"):
        Config.load(None, ["cache.storage.timeout_s=0"])
    assert Config.load(None, []).cache.storage.timeout_s == 2.0


def test_a_redis_down_at_open_is_an_error_or_if_not_required_a_warning_until_it_is_up(tmp_path):
    needs_redis()
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(StorageUnavailable, match="refused"):
        open_backend("redis", fingerprint=FP, url=url)  # a command line wants to know at once
    log = RecordingLog()
    store = open_backend("redis", fingerprint=FP, url=url, log=log, require_server=False)
    with closing(store):
        assert [line[:2] for line in log.lines] == [("warning", "storage.unreachable")]
        assert log.lines[0][2]["where"] == f"127.0.0.1:{url_port(url)}"
        with pytest.raises(StorageUnavailable, match="refused"):
            store.put_many(items(0))
        with redis_server(tmp_path, port=url_port(url)):  # the server comes up late
            assert store.put_many(items(0)) == 1
            assert store.get_many([key(0)]) == [payload(0)]


def test_the_engine_and_the_store_lane_open_a_redis_that_is_down_and_count_misses(tmp_path):
    needs_redis()
    url = f"redis://127.0.0.1:{free_port()}/0"
    model = ModelInfo(
        model_id="preset-tiny-seed0", vocab_size=259, max_position=2048, dtype="float32",
        bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    config = Config.load(None, ["cache.storage.backend=redis", f"cache.storage.url={url}"])
    log = RecordingLog()
    storage = open_all_ranks(config, model, str(tmp_path), log=log)
    assert storage is not None
    (client,) = storage.ranks
    assert isinstance(client, GuardedBackend)
    with closing(storage):
        assert storage.longest_prefix([key(0)]) == 0  # a miss, never an exception
        assert not client.available


def test_a_stopped_redis_fails_every_call_at_once_and_a_restart_on_its_port_serves_again(
    tmp_path,
):
    needs_redis()
    log, clock = RecordingLog(), Clock()
    with redis_server(tmp_path) as url:
        store = RedisBackend(url, fingerprint=FP, log=log, socket_timeout_s=5.0)
        guarded = GuardedBackend(store, log=log, clock=clock)
        store.put_many(items(0, 1))
        assert guarded.longest_prefix([key(0), key(1)]) == 2
    with closing(store):
        calls = {
            "put_many": lambda: store.put_many(items(2)),
            "get_many": lambda: store.get_many([key(0)]),
            "get_into": lambda: store.get_into([(key(0), bytearray(BLOCK))]),
            "longest_prefix": lambda: store.longest_prefix([key(0)]),
            "delete": lambda: store.delete([key(0)]),
        }
        for name, call in calls.items():
            start = time.monotonic()
            with pytest.raises(StorageUnavailable, match="refused"):
                call()
            assert time.monotonic() - start < FAST_S, name
        assert guarded.longest_prefix([key(0), key(1)]) == 0
        with redis_server(tmp_path, port=url_port(url)):
            # The pool reconnects by itself; the restarted server is empty (no persistence).
            assert store.get_many([key(0)]) == [None]
            assert store.put_many(items(0)) == 1
            assert store.get_many([key(0)]) == [payload(0)]
            clock.now += guarded.backoff_s  # the guard asks again once its back-off passed
            assert guarded.longest_prefix([key(0), key(1)]) == 1
    assert [line[:2] for line in log.lines] == [
        ("warning", "storage.unavailable"),
        ("info", "storage.restored"),
    ]


# --- local: a full directory, failing writes and reads --------------------------------------


class FailingFiles(BlobFiles):
    """The blob files of ``files``, but writes of the keys in ``failing`` stop half-way with
    ``error``."""

    def __init__(self, files: BlobFiles, *, failing: set[BlockHash], error: int) -> None:
        super().__init__(
            files.directory, fingerprint=files.fingerprint, seal=files.seal, fsync=files.fsync
        )
        self.failing = failing
        self.error = error

    def _write_blob(self, fd: int, view: memoryview, tail: bytes) -> None:
        if bytes(tail[24:40]) in self.failing:  # the trailer's key field
            os.write(fd, view[: len(view) // 2])  # a partial temp file, as a full disk leaves
            raise OSError(self.error, os.strerror(self.error))
        super()._write_blob(fd, view, tail)


class FailingWrites(LocalBackend):
    """A local backend whose writes of the keys in ``failing`` stop half-way with ``errno``."""

    def __init__(self, root: Path, *, failing: set[BlockHash], error: int, **kwargs) -> None:
        super().__init__(root, fingerprint=FP, fsync=False, num_threads=1, **kwargs)
        self.files = FailingFiles(self.files, failing=failing, error=error)


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EDQUOT, errno.EIO])
def test_a_block_that_cannot_be_written_is_not_visible_and_the_put_raises_after_the_others(
    tmp_path, error
):
    log = RecordingLog()
    with closing(FailingWrites(tmp_path, failing={key(1)}, error=error, log=log)) as store:
        with pytest.raises(StorageWriteFailed) as raised:
            store.put_many(items(0, 1, 2))
        assert raised.value.errno == error
        assert (raised.value.failed, raised.value.written) == (1, 2)
        assert isinstance(raised.value, OSError)
        assert temp_files(tmp_path) == []
        assert not os.path.exists(store.path_for(key(1)))
        assert store.get_many([key(1), key(2)]) == [None, payload(2)]
        # A full disk also made room: the least recently used block (0) went.
        full = error in (errno.ENOSPC, errno.EDQUOT)
        assert store.get_many([key(0)]) == [None if full else payload(0)]
        assert (store.stats().failed_puts, store.stats().evictions) == (1, int(full))
        (logged,) = log.events("storage.write_failed")
        assert logged == {
            "backend": "local",
            "failed": 1,
            "written": 2,
            "error": f"[Errno {error}] {os.strerror(error)}",
        }
        assert log.events("storage.corrupt") == []


def test_a_full_disk_evicts_the_least_recently_used_blocks_to_make_room_for_the_next_put(
    tmp_path,
):
    with closing(FailingWrites(tmp_path, failing={key(9)}, error=errno.ENOSPC)) as store:
        store.put_many(items(0, 1, 2))
        store.get_many([key(0)])  # 0 is now the most recently used
        with pytest.raises(StorageWriteFailed):
            store.put_many(items(9))
        # Room for one block was made: the least recently used one (1) went.
        assert [store.longest_prefix([key(i)]) for i in (1, 2, 0)] == [0, 1, 1]
        assert store.stats().evictions == 1
        with pytest.raises(StorageWriteFailed):
            store.put_many(items(9))
        assert [store.longest_prefix([key(i)]) for i in (2, 0)] == [0, 1]  # then the next one


def test_an_io_error_that_is_not_a_full_disk_evicts_nothing(tmp_path):
    with closing(FailingWrites(tmp_path, failing={key(9)}, error=errno.EIO)) as store:
        store.put_many(items(0, 1))
        with pytest.raises(StorageWriteFailed):
            store.put_many(items(9))
        assert store.stats().evictions == 0
        assert store.longest_prefix([key(0), key(1)]) == 2


@pytest.mark.parametrize("call", ["fdatasync", "replace", "close"])
def test_a_flush_rename_or_close_that_fails_leaves_no_temp_file_and_no_block(
    tmp_path, monkeypatch, call
):
    real = getattr(os, call)

    def failing(*args, **kwargs):
        if call == "close":
            real(*args, **kwargs)  # the descriptor is released, as Linux does on an error
        raise OSError(errno.EIO, f"{call} failed")

    with closing(LocalBackend(tmp_path, fingerprint=FP, num_threads=1)) as store:
        monkeypatch.setattr(os, call, failing)
        with pytest.raises(StorageWriteFailed, match=f"{call} failed"):
            store.put_many(items(0))
        monkeypatch.undo()
        assert temp_files(tmp_path) == []
        assert store.get_many([key(0)]) == [None]


def test_a_read_error_is_a_logged_miss_and_the_file_stays(tmp_path, monkeypatch):
    log = RecordingLog()
    with closing(LocalBackend(tmp_path, fingerprint=FP, num_threads=1, log=log)) as store:
        store.put_many(items(0, 1))

        def pread(fd: int, length: int, offset: int) -> bytes:
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "pread", pread)
        assert store.get_many([key(0)]) == [None]
        assert store.get_into([(key(1), bytearray(BLOCK))]) == [False]
        monkeypatch.undo()
        assert [e["key"] for e in log.events("storage.read_failed")] == [key(0).hex(), key(1).hex()]
        assert log.events("storage.corrupt") == []
        stats = store.stats()
        assert (stats.read_errors, stats.misses, stats.hits) == (2, 2, 0)
        assert store.get_many([key(0), key(1)]) == [payload(0), payload(1)]  # it passed


def test_a_blob_whose_recency_cannot_be_set_still_reads(tmp_path, monkeypatch):
    with closing(LocalBackend(tmp_path, fingerprint=FP, num_threads=1)) as store:
        store.put_many(items(0))

        def utime(*args, **kwargs):
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(os, "utime", utime)
        assert store.get_many([key(0)]) == [payload(0)]


@pytest.fixture
def small_tmpfs(tmp_path) -> Iterator[Path]:
    """A 64 KiB tmpfs (16 pages) under tmp_path."""
    with mounted_tmpfs(tmp_path / "tmpfs", "64k") as point:
        yield point


def test_a_small_tmpfs_fills_up_gives_a_failed_put_with_enospc_and_only_whole_blocks(
    small_tmpfs,
):
    log = RecordingLog()
    # One thread: blocks written side by side could each take part of the space and all fail.
    with closing(LocalBackend(small_tmpfs, fingerprint=FP, log=log, num_threads=1)) as store:
        with pytest.raises(StorageWriteFailed) as raised:
            store.put_many(items(*range(4)))  # 4 blobs of 5 pages each into 16 pages
        assert raised.value.errno == errno.ENOSPC
        assert (raised.value.written, raised.value.failed) == (3, 1)
        assert temp_files(small_tmpfs) == []
        # Room for the failed block was made: the least recently used block went.
        assert store.longest_prefix([key(0)]) == 0
        assert store.longest_prefix([key(1), key(2)]) == 2
        for path in small_tmpfs.rglob("*"):
            if path.is_file():  # every visible blob is whole and valid
                decode(FP, BlockHash(bytes.fromhex(path.name)), path.read_bytes())
        # The failed put made room, so the next write-back of a block goes through.
        assert store.put_many(items(100)) == 1
        assert store.get_many([key(100)]) == [payload(100)]
    assert len(log.events("storage.write_failed")) == 1


# --- wiring in files owned elsewhere (the engine, the store lane) -----------------------------


def keywords_of_calls(module: ModuleType, function: str) -> list[set[str]]:
    """The keyword names of every call of ``function`` in the source of ``module``."""
    tree = ast.parse(Path(inspect.getfile(module)).read_text())
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == function
    ]
    return [{kw.arg for kw in call.keywords if kw.arg} for call in calls]


def test_the_engine_gives_its_log_to_its_storage_client():
    from ringfence.actors.engine import begin

    calls = keywords_of_calls(begin, "open_all_ranks")
    assert calls and all("log" in keywords for keywords in calls)


def test_the_store_lane_gives_the_timeout_setting_to_its_storage_client(monkeypatch):
    from ringfence.actors.executors import store

    # The lane opens its tier from the whole [cache.storage] section, through the one way...
    calls = keywords_of_calls(store, "open_storage")
    assert calls and all({"fingerprint", "run_dir", "log"} <= keywords for keywords in calls)
    tree = ast.parse(Path(inspect.getfile(store)).read_text())
    sections = [
        ast.unparse(node.args[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "open_storage"
    ]
    assert sections == ["self.config.cache.storage"]
    # ... which hands the backend every setting, the timeout included.
    places: list[Place] = []

    def opener(fingerprint: bytes, place: Place, log: object) -> StorageBackend:
        places.append(place)
        return MemoryBackend(fingerprint=fingerprint)

    monkeypatch.setitem(BACKENDS, "probe", Backend(open=opener, shared=False))
    settings = StorageConfig(backend="probe", timeout_s=0.3)
    open_storage(settings, fingerprint=FP, run_dir=None).close()
    assert [p.timeout_s for p in places] == [0.3]


def answer_settled(guarded: GuardedBackend, timeout: float) -> bool:
    """Wait up to ``timeout`` s for a question still in the guard's backend to end (the
    guard's next question then settles it); True if none is left in it."""
    late = guarded._late
    if late is None:
        return True
    try:
        late.exception(timeout=timeout)
    except TimeoutError:
        return False
    return True


class Hung:
    """A backend whose presence question waits until released: a server that stopped
    answering (until ``release`` is set), then answers ``answer`` or raises ``error``."""

    name = "hung"

    def __init__(self, answer: int = 0, error: Exception | None = None) -> None:
        self.answer, self.error = answer, error
        self.release = threading.Event()
        self.calls = 0

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        self.calls += 1
        assert self.release.wait(MOUNT_TIMEOUT_S), "never released"
        if self.error is not None:
            raise self.error
        return self.answer

    def close(self) -> None:
        self.release.set()


def test_a_hung_backend_costs_the_engine_answer_s_once_and_misses_until_it_answers():
    log, hung = RecordingLog(), Hung(answer=2)
    guarded = GuardedBackend(cast(StorageBackend, hung), log=log, answer_s=0.05)
    with closing(guarded):
        start = time.monotonic()
        assert guarded.longest_prefix([key(0), key(1)]) == 0
        assert 0.05 <= time.monotonic() - start < 0.05 + FAST_S
        start = time.monotonic()
        assert [guarded.longest_prefix([key(0)]) for _ in range(100)] == [0] * 100
        assert time.monotonic() - start < FAST_S and hung.calls == 1  # not asked while hung
        hung.release.set()
        assert answer_settled(guarded, MOUNT_TIMEOUT_S)
        assert guarded.longest_prefix([key(0), key(1)]) == 2
    assert [line[:2] for line in log.lines] == [
        ("warning", "storage.unavailable"),
        ("info", "storage.restored"),
    ]
    assert "no answer within 0.05 s" in str(log.lines[0][2]["error"])


def test_a_hung_question_that_ends_in_an_error_starts_the_back_off():
    log, clock = RecordingLog(), Clock()
    hung = Hung(error=StorageUnavailable("redis at x: Timeout reading from socket"))
    guarded = GuardedBackend(cast(StorageBackend, hung), log=log, answer_s=0.05, clock=clock)
    with closing(guarded):
        assert guarded.longest_prefix([key(0)]) == 0
        hung.release.set()
        assert answer_settled(guarded, MOUNT_TIMEOUT_S)
        assert guarded.longest_prefix([key(0)]) == 0  # the error is settled: back-off begins
        assert guarded.longest_prefix([key(0)]) == 0 and hung.calls == 1
        clock.now += guarded.backoff_s
        assert guarded.longest_prefix([key(0)]) == 0 and hung.calls == 2  # asked again
    assert [line[1] for line in log.lines] == ["storage.unavailable"]


def test_a_redis_that_never_answers_costs_the_engine_answer_s_not_its_timeout(silent_server):
    pytest.importorskip("redis")
    store = RedisBackend(silent_server, fingerprint=FP, socket_timeout_s=1.0, require_server=False)
    guarded = GuardedBackend(store, log=RecordingLog(), answer_s=0.05)
    with closing(guarded):
        start = time.monotonic()
        assert guarded.longest_prefix([key(0)]) == 0
        assert time.monotonic() - start < 0.05 + FAST_S < 1.0

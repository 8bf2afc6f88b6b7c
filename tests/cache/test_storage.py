"""Storage backends: one behaviour over local, redis and memory; torn and racing writes."""

from __future__ import annotations

import hashlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

from ringfence.actors.tools.testing.redis_server import free_port
from ringfence.actors.tools.testing.shm import reap_subprocess
from ringfence.actors.tools.testing.storage import RecordingLog, read_blob, write_blob
from ringfence.cache.ids import BlockHash
from ringfence.cache.storage import StorageUnavailable
from ringfence.cache.storage.blob import TRAILER, CorruptBlock, decode, encode
from ringfence.cache.storage.blob_index import TMP_PREFIX
from ringfence.cache.storage.local import LocalBackend
from ringfence.cache.storage.memory import MemoryBackend
from ringfence.cache.storage.redis_backend import RedisBackend
from ringfence.cache.storage.registry import open_backend
from ringfence.shm.errors import ConfigError

FP = hashlib.blake2b(b"model-a", digest_size=16).digest()
OTHER_FP = hashlib.blake2b(b"model-b", digest_size=16).digest()
BLOCK = 4096
CHILD_TIMEOUT_S = 30.0


def key(i: int) -> BlockHash:
    return BlockHash(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest())


def payload(i: int, size: int = BLOCK) -> bytes:
    return bytes((i + j) % 251 for j in range(size))


def stored(store, k: BlockHash) -> bytes:
    """The raw blob a backend holds for ``k``, which must be there."""
    blob = read_blob(store, k)
    assert blob is not None, f"{k.hex()} is not stored"
    return blob


@pytest.fixture(params=["local", "redis", "memory"])
def make(request, tmp_path):
    """A builder of backends of one kind, all sharing one store; each closed after the test."""
    name = request.param
    url = ""
    if name == "redis":
        import redis

        url = request.getfixturevalue("redis_url")
        with redis.Redis.from_url(url) as client:
            client.flushdb()
    opened = []

    def build(*, max_bytes=0, fingerprint=FP, log=None):
        backend = open_backend(
            name,
            fingerprint=fingerprint,
            path=str(tmp_path / "store"),
            url=url,
            max_bytes=max_bytes,
            log=log if log is not None else RecordingLog(),
        )
        opened.append(backend)
        return backend

    yield build
    for backend in opened:
        backend.close()


# --- the behaviour every backend shares ---------------------------------------------------


def test_a_stored_block_reads_back_byte_for_byte_and_an_unknown_key_misses(make):
    store = make()
    assert store.put_many([(key(0), payload(0)), (key(1), payload(1))]) == 2
    assert store.get_many([key(1), key(2), key(0)]) == [payload(1), None, payload(0)]
    stats = store.stats()
    assert (stats.num_blocks, stats.num_bytes) == (2, 2 * (TRAILER.size + BLOCK))
    assert (stats.num_puts, stats.hits, stats.misses, stats.corrupt) == (2, 2, 1, 0)


def test_a_payload_may_be_any_contiguous_buffer(make):
    store = make()
    words = memoryview(bytearray(payload(3))).cast("I")
    store.put_many([(key(0), words), (key(1), bytearray(payload(4))), (key(2), b"")])
    assert store.get_many([key(0), key(1), key(2)]) == [payload(3), payload(4), b""]


def test_get_into_reads_each_hit_straight_into_its_buffer(make):
    store = make()
    store.put_many([(key(0), payload(0)), (key(1), payload(1))])
    buffers = [bytearray(BLOCK) for _ in range(3)]
    words = memoryview(buffers[2]).cast("I")  # any writable contiguous buffer will do
    got = store.get_into([(key(1), buffers[0]), (key(5), buffers[1]), (key(0), words)])
    assert got == [True, False, True]
    assert buffers == [payload(1), bytearray(BLOCK), payload(0)]
    stats = store.stats()
    assert (stats.hits, stats.misses) == (2, 1)


def test_get_into_a_buffer_of_the_wrong_size_is_a_caller_error(make):
    store = make()
    store.put_many([(key(0), payload(0))])
    with pytest.raises(ValueError, match=f"has {BLOCK} bytes, its buffer {BLOCK - 1}"):
        store.get_into([(key(0), bytearray(BLOCK - 1))])


def test_get_into_a_corrupt_blob_is_a_logged_miss(make):
    log = RecordingLog()
    store = make(log=log)
    store.put_many([(key(0), payload(0))])
    write_blob(store, key(0), flip(stored(store, key(0)), 7))
    assert store.get_into([(key(0), bytearray(BLOCK))]) == [False]
    assert [fields["reason"] for fields in log.events("storage.corrupt")] == ["checksum"]
    assert read_blob(store, key(0)) is None


def test_putting_a_stored_key_again_writes_nothing_and_keeps_its_bytes(make):
    store = make()
    assert store.put_many([(key(0), payload(0))]) == 1
    assert store.put_many([(key(0), payload(0)), (key(1), payload(1))]) == 1
    assert store.get_many([key(0), key(1)]) == [payload(0), payload(1)]
    assert store.stats().num_puts == 2


def test_the_longest_prefix_counts_only_the_leading_keys_present(make):
    store = make()
    store.put_many([(key(i), payload(i)) for i in (0, 1, 3)])
    keys = [key(i) for i in range(4)]
    assert store.longest_prefix(keys) == 2
    assert store.longest_prefix(keys[2:]) == 0
    assert store.longest_prefix(keys[:2]) == 2
    assert store.longest_prefix([]) == 0


def test_delete_removes_only_the_given_keys_and_counts_those_that_were_stored(make):
    store = make()
    store.put_many([(key(i), payload(i)) for i in range(3)])
    assert store.delete([key(0), key(2), key(7)]) == 2
    assert store.get_many([key(0), key(1), key(2)]) == [None, payload(1), None]
    assert store.stats().num_blocks == 1


def test_a_second_backend_on_the_same_store_finds_the_blocks_of_the_first(make):
    writer, reader = make(), make()
    if isinstance(reader, MemoryBackend):
        pytest.skip("a memory store is private to its object")
    writer.put_many([(key(0), payload(0))])
    assert reader.longest_prefix([key(0)]) == 1
    assert reader.get_many([key(0)]) == [payload(0)]


def flip(blob: bytes, at: int) -> bytes:
    return blob[:at] + bytes([blob[at] ^ 0x01]) + blob[at + 1 :]


def replace(blob: bytes, at: int, new: bytes) -> bytes:
    return blob[:at] + new + blob[at + len(new) :]


# damage -> (what it does to a blob of one BLOCK-byte payload, the reason reported)
TAMPER = {
    "flipped payload byte": (lambda blob: flip(blob, BLOCK // 3), "checksum"),
    "flipped trailer byte": (lambda blob: flip(blob, BLOCK + 6), "checksum"),  # reserved field
    "cut short": (lambda blob: blob[:-10], "magic"),
    "cut below a trailer": (lambda blob: blob[: TRAILER.size - 1], "short"),
    "lost its start": (lambda blob: blob[BLOCK // 2 :], "length"),
    "bad magic": (lambda blob: replace(blob, BLOCK, b"XXXX"), "magic"),
    "newer format": (lambda blob: replace(blob, BLOCK + 4, b"\x03\x00"), "version"),
    "foreign fingerprint": (
        lambda blob: encode(OTHER_FP, key(0), decode(FP, key(0), blob)),
        "fingerprint",
    ),
    "another block's blob": (lambda blob: encode(FP, key(9), decode(FP, key(0), blob)), "key"),
}


@pytest.mark.parametrize("damage", list(TAMPER))
def test_a_damaged_or_foreign_blob_is_a_logged_miss_and_is_removed(make, damage):
    log = RecordingLog()
    store = make(log=log)
    store.put_many([(key(0), payload(0))])
    tamper, reason = TAMPER[damage]
    write_blob(store, key(0), tamper(stored(store, key(0))))
    assert store.get_many([key(0)]) == [None]
    assert log.errors == [
        ("storage.corrupt", {"backend": store.name, "key": key(0).hex(), "reason": reason})
    ]
    stats = store.stats()
    assert (stats.hits, stats.misses, stats.corrupt) == (0, 1, 1)
    assert read_blob(store, key(0)) is None
    assert store.put_many([(key(0), payload(0))]) == 1  # so a write-back can store it again
    assert store.get_many([key(0)]) == [payload(0)]


def test_a_backend_of_another_fingerprint_never_returns_the_block(make):
    store = make()
    store.put_many([(key(0), payload(0))])
    other = make(fingerprint=OTHER_FP)
    assert other.get_many([key(0)]) == [None]


def test_two_fingerprints_store_one_key_side_by_side_and_each_reads_its_own(make):
    log = RecordingLog()
    rank0, rank1 = make(log=log), make(fingerprint=OTHER_FP, log=log)
    assert rank0.put_many([(key(0), payload(0))]) == 1
    assert rank1.longest_prefix([key(0)]) == 0  # rank 0's shard is not rank 1's
    assert rank1.put_many([(key(0), payload(1)), (key(1), payload(2))]) == 2
    assert rank0.get_many([key(0), key(1)]) == [payload(0), None]
    assert rank1.get_many([key(0), key(1)]) == [payload(1), payload(2)]
    assert log.errors == []  # neither blob read as the other's (a foreign fingerprint)
    assert (rank0.stats().num_blocks, rank1.stats().num_blocks) == (1, 2)
    assert rank1.delete([key(0)]) == 1
    assert rank0.get_many([key(0)]) == [payload(0)]


def test_each_fingerprint_is_bounded_and_evicted_on_its_own(make):
    bound = 2 * (TRAILER.size + BLOCK)
    rank0, rank1 = make(max_bytes=bound), make(max_bytes=bound, fingerprint=OTHER_FP)
    if rank0.name == "redis":
        pytest.skip("redis evicts by the server's maxmemory-policy, not by max_bytes")
    rank0.put_many([(key(i), payload(i)) for i in range(2)])
    rank1.put_many([(key(i), payload(i)) for i in range(3)])  # past its bound: evicts key 0
    assert rank1.longest_prefix([key(0)]) == 0 and rank1.stats().evictions == 1
    assert rank0.longest_prefix([key(0), key(1)]) == 2 and rank0.stats().evictions == 0
    if rank0.name == "local":  # a rescan of the shared root indexes rank 0's blocks only
        reopened = make(max_bytes=bound)
        assert (reopened.stats().num_blocks, reopened.stats().num_bytes) == (2, bound)


def test_blocks_past_max_bytes_are_evicted_least_recently_used_first(make):
    store = make(max_bytes=3 * (TRAILER.size + BLOCK))
    if store.name == "redis":
        pytest.skip("redis evicts by the server's maxmemory-policy, not by max_bytes")
    store.put_many([(key(i), payload(i)) for i in range(3)])
    assert store.get_many([key(0)]) == [payload(0)]  # key 1 is now the least recently used
    store.put_many([(key(3), payload(3))])
    assert store.longest_prefix([key(1)]) == 0
    assert [store.longest_prefix([key(i)]) for i in (0, 2, 3)] == [1, 1, 1]
    stats = store.stats()
    assert (stats.num_blocks, stats.evictions) == (3, 1)


def test_a_key_that_is_not_a_16_byte_digest_is_rejected(make):
    store = make()
    with pytest.raises(ValueError, match="16 bytes"):
        store.put_many([(BlockHash(b"short"), b"x")])
    with pytest.raises(ValueError, match="16 bytes"):
        store.get_many([BlockHash(b"short")])


def test_a_closed_backend_refuses_calls_and_closes_again_quietly(make):
    store = make()
    store.close()
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.get_many([key(0)])


# --- opening by name --------------------------------------------------------------------


def test_an_unknown_backend_or_a_missing_setting_names_the_config_key(tmp_path):
    with pytest.raises(ConfigError, match="one of 'local', 'redis', 'memory', 'none'") as e:
        open_backend("s3", fingerprint=FP)
    assert e.value.key == "cache.storage.backend"
    with pytest.raises(ConfigError) as e:
        open_backend("local", fingerprint=FP)
    assert e.value.key == "cache.storage.path"
    with pytest.raises(ConfigError) as e:
        open_backend("redis", fingerprint=FP)
    assert e.value.key == "cache.storage.url"
    with pytest.raises(ValueError, match="fingerprint must be 16 bytes"):
        open_backend("memory", fingerprint=b"fp")


def test_the_none_backend_stores_nothing_and_finds_nothing():
    with closing(open_backend("none", fingerprint=FP)) as store:
        assert store.put_many([(key(0), payload(0))]) == 0
        assert store.get_many([key(0)]) == [None]
        assert store.get_into([(key(0), bytearray(BLOCK))]) == [False]
        assert store.longest_prefix([key(0)]) == 0
        assert store.stats().misses == 2


def test_without_a_log_a_corrupt_blob_is_reported_to_the_stdlib_logger(caplog):
    with closing(MemoryBackend(fingerprint=FP)) as store:
        store.put_many([(key(0), payload(0))])
        store.replace_blob(key(0), b"garbage")
        with caplog.at_level(logging.ERROR, logger="ringfence.cache.storage"):
            assert store.get_many([key(0)]) == [None]
    (record,) = caplog.records
    assert record.getMessage() == f"storage.corrupt backend=memory key={key(0).hex()} reason=short"


def test_decode_names_the_key_and_the_reason():
    with pytest.raises(CorruptBlock, match=f"block {key(0).hex()}: magic: ") as e:
        decode(FP, key(0), b"\0" * 64)
    assert e.value.reason == "magic"


def test_importing_the_package_and_its_redis_module_does_not_import_redis(tmp_path):
    code = "import sys, ringfence.cache.storage.redis_backend\n"
    code += "import ringfence.actors.tools.testing.storage\n"
    code += "print('redis' in sys.modules)"
    cmd = [sys.executable, "-c", code]
    out = subprocess.run(cmd, check=False, cwd=tmp_path, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr


# --- redis ------------------------------------------------------------------------------


def test_redis_keys_are_named_by_the_fingerprint_and_the_block_key(redis_url):
    with closing(RedisBackend(redis_url, fingerprint=FP)) as store:
        store.client.flushdb()
        store.put_many([(key(0), payload(0))])
        assert store.client.keys() == [f"rf:{FP.hex()}:{key(0).hex()}".encode()]


def test_an_unreachable_redis_raises_storage_unavailable_at_open():
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(StorageUnavailable, match=r"redis at 127\.0\.0\.1"):
        open_backend("redis", fingerprint=FP, url=url)


# --- local: files, processes, crashes ---------------------------------------------------


def files_under(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file())


def test_a_local_block_is_a_file_named_by_its_key_under_its_fingerprint_and_first_byte(
    tmp_path,
):
    with closing(LocalBackend(tmp_path, fingerprint=FP, fsync=False)) as store:
        store.put_many([(key(0), payload(0))])
        where = tmp_path / FP.hex() / key(0).hex()[:2] / key(0).hex()
        assert store.path_for(key(0)) == str(where) and where.is_file()
        assert files_under(tmp_path) == [key(0).hex()]


def test_reopening_a_directory_restores_its_blocks_in_order_of_last_use(tmp_path):
    with closing(LocalBackend(tmp_path, fingerprint=FP)) as store:
        store.put_many([(key(i), payload(i)) for i in range(4)])
        store.get_many([key(1), key(0)])  # use order now: 2, 3, 1, 0
    with closing(LocalBackend(tmp_path, fingerprint=FP, max_bytes=2 * (TRAILER.size + BLOCK))):
        pass  # evicts down to its bound on open
    assert files_under(tmp_path) == sorted([key(1).hex(), key(0).hex()])


def test_a_block_another_process_evicted_is_a_miss_and_leaves_the_index(tmp_path):
    with (
        closing(LocalBackend(tmp_path, fingerprint=FP)) as a,
        closing(LocalBackend(tmp_path, fingerprint=FP)) as b,
    ):
        a.put_many([(key(0), payload(0))])
        assert b.get_many([key(0)]) == [payload(0)]
        a.delete([key(0)])
        assert b.get_many([key(0)]) == [None]
        assert b.stats().num_blocks == 0


def read_line(proc: subprocess.Popen[bytes], deadline: float) -> bytes:
    """One line of a child's stdout, waiting at most until ``deadline`` (monotonic)."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
    if not ready:
        pytest.fail(f"child {proc.pid} said nothing in time")
    return proc.stdout.readline()


def start_child(code: str, *args: str, cwd: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=cwd,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )


def reap(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a child by its pid if it still runs, wait for it, close its pipes."""
    reap_subprocess(proc, CHILD_TIMEOUT_S)


STALLING_WRITER = """
import os, sys
from ringfence.cache.storage.blob_files import BlobFiles
from ringfence.cache.storage.local import LocalBackend

def stalling(self, fd, view, tail):
    os.write(fd, view[: len(view) // 2])
    print("torn", flush=True)
    sys.stdin.read()  # blocks until the parent kills this process

BlobFiles._write_blob = stalling  # this process only writes the one torn block
root, fingerprint, key = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
LocalBackend(root, fingerprint=fingerprint).put_many([(key, b"x" * (1 << 20))])
"""


def test_a_writer_killed_mid_write_leaves_no_visible_block_and_its_temp_file_is_removed(
    tmp_path,
):
    root = tmp_path / "store"
    child = start_child(STALLING_WRITER, str(root), FP.hex(), key(0).hex(), cwd=tmp_path)
    try:
        assert read_line(child, time.monotonic() + CHILD_TIMEOUT_S) == b"torn\n"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(CHILD_TIMEOUT_S) == -signal.SIGKILL
    finally:
        reap(child)
    (left,) = files_under(root)
    assert left.startswith(f"{TMP_PREFIX}{child.pid}-")
    with closing(LocalBackend(root, fingerprint=FP, log=RecordingLog())) as store:
        assert files_under(root) == []  # its writer is dead: removed on open
        assert store.longest_prefix([key(0)]) == 0
        assert store.get_many([key(0)]) == [None]
        assert store.stats().corrupt == 0


RACING_WRITER = """
import sys
from ringfence.cache.storage.local import LocalBackend

root, fingerprint, key = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
fill, rounds = int(sys.argv[4]), int(sys.argv[5])
store = LocalBackend(root, fingerprint=fingerprint)
value = bytes([fill]) * (1 << 20)
print("ready", flush=True)
sys.stdin.readline()
written = 0
for _ in range(rounds):
    store.delete([key])
    written += store.put_many([(key, value)])
print(written, flush=True)
"""


def test_two_processes_writing_one_key_both_succeed_and_a_reader_sees_only_whole_values(
    tmp_path,
):
    root = tmp_path / "store"
    values = {fill: bytes([fill]) * (1 << 20) for fill in (0xAA, 0x55)}
    args = (str(root), FP.hex(), key(0).hex())
    writers = [start_child(RACING_WRITER, *args, str(f), "20", cwd=tmp_path) for f in values]
    log = RecordingLog()
    try:
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        assert [read_line(w, deadline) for w in writers] == [b"ready\n"] * 2
        for w in writers:
            assert w.stdin is not None
            w.stdin.write(b"go\n")
            w.stdin.flush()
        seen = {"miss": 0, "A": 0, "B": 0}
        with closing(LocalBackend(root, fingerprint=FP, log=log)) as reader:
            while any(w.poll() is None for w in writers) and time.monotonic() < deadline:
                (value,) = reader.get_many([key(0)])
                if value is None:
                    seen["miss"] += 1
                else:
                    assert value in values.values(), "a reader saw a value no writer wrote"
                    seen["A" if value == values[0xAA] else "B"] += 1
            assert [w.wait(CHILD_TIMEOUT_S) for w in writers] == [0, 0]
            assert sum(int(read_line(w, deadline)) for w in writers) >= 1
            assert reader.get_many([key(0)])[0] in values.values()
        print(f"reads: {seen}")
    finally:
        for w in writers:
            reap(w)
    assert log.errors == []
    assert files_under(root) == [key(0).hex()]


def test_a_local_store_without_fsync_keeps_the_same_blocks(tmp_path):
    with closing(LocalBackend(tmp_path, fingerprint=FP, fsync=False)) as store:
        assert store.put_many([(key(i), payload(i)) for i in range(3)]) == 3
        assert store.get_many([key(i) for i in range(3)]) == [payload(i) for i in range(3)]

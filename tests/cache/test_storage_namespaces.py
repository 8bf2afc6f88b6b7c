"""Storage secrets' key spaces: a reader never destroys a blob it cannot verify.

Each test shares one tier (one redis server, or one local directory) between several
clients, as instances that share a tier do: clients holding one secret, another, or none.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
from contextlib import closing
from pathlib import Path

import pytest

from ringfence.actors.tools.testing.storage import RecordingLog, read_blob, write_blob
from ringfence.cache.ids import BlockHash
from ringfence.cache.storage.blob import END_BYTES, encode
from ringfence.cache.storage.local import LocalBackend
from ringfence.cache.storage.redis_backend import RedisBackend
from ringfence.cache.storage.registry import open_backend
from ringfence.cache.storage.seal import Seal

FP = hashlib.blake2b(b"model-a", digest_size=16).digest()
BLOCK = 4096
BLOB = BLOCK + END_BYTES  # a sealed blob's bytes
S1 = Seal(b"the secret before the rotation")
S2 = Seal(b"the secret after the rotation")
THREAD_TIMEOUT_S = 60.0


def key(i: int) -> BlockHash:
    return BlockHash(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest())


def payload(i: int) -> bytes:
    return bytes((i + j) % 251 for j in range(BLOCK))


def blocks(numbers: range | list[int]) -> list[tuple[BlockHash, bytes]]:
    return [(key(i), payload(i)) for i in numbers]


@pytest.fixture(params=["redis", "local"])
def tier(request, tmp_path):
    """A builder of clients of one shared tier (an emptied redis server, or one directory),
    each with the seal it is given (or none); every client is closed after the test."""
    name = request.param
    url = ""
    if name == "redis":
        import redis

        url = request.getfixturevalue("redis_url")
        with redis.Redis.from_url(url) as client:
            client.flushdb()
    opened = []

    def build(*, seal=None, log=None):
        backend = open_backend(
            name,
            fingerprint=FP,
            path=str(tmp_path / "store"),
            url=url,
            max_bytes=0,
            log=log if log is not None else RecordingLog(),
            seal=seal,
        )
        opened.append(backend)
        return backend

    yield build
    for backend in opened:
        backend.close()


def test_a_reader_with_another_secret_finds_nothing_deletes_nothing_and_the_first_secret_reads_all(
    tier,
):
    n = 64
    keys = [key(i) for i in range(n)]
    writer = tier(seal=S1)  # A
    assert writer.put_many(blocks(range(n))) == n
    log = RecordingLog()
    stranger = tier(seal=S2, log=log)  # B: another secret, the one that used to erase the tier
    assert stranger.longest_prefix(keys) == 0
    assert stranger.get_many(keys) == [None] * n
    assert stranger.get_into([(k, bytearray(BLOCK)) for k in keys]) == [False] * n
    stats = stranger.stats()
    assert (stats.hits, stats.misses, stats.corrupt, stats.forged) == (0, 2 * n, 0, 0)
    assert log.errors == []
    trusting = tier()  # no secret: the plain key space, where nothing was written
    assert trusting.get_many(keys[:1]) == [None] and trusting.stats().corrupt == 0
    holder = tier(seal=S1)  # C: A's own secret
    got = holder.get_many(keys)
    print(f"blocks the first secret's second reader gets back: {sum(p is not None for p in got)}")
    assert got == [payload(i) for i in range(n)]
    assert holder.longest_prefix(keys) == n


def test_two_secrets_keep_one_key_side_by_side_and_each_deletes_only_its_own(tier):
    before, after = tier(seal=S1), tier(seal=S2)
    assert before.put_many([(key(0), payload(0))]) == 1
    assert after.put_many([(key(0), payload(1))]) == 1  # not skipped: another key space
    assert before.get_many([key(0)]) == [payload(0)]
    assert after.get_many([key(0)]) == [payload(1)]
    assert before.delete([key(0)]) == 1
    assert (before.get_many([key(0)]), after.get_many([key(0)])) == ([None], [payload(1)])


# damage -> (the blob that replaces a sealed blob of payload(0), whether a sealed reader
# takes it for a forgery (else: corrupt))
OWN_SPACE_DAMAGE = {
    "a plain blob, its checksum right": (lambda blob: encode(FP, key(0), bytes(BLOCK)), True),
    "a flipped payload byte": (lambda blob: blob[:9] + bytes([blob[9] ^ 1]) + blob[10:], True),
    "sealed by the other secret": (lambda blob: encode(FP, key(0), payload(0), S2), True),
    "cut in half": (lambda blob: blob[: len(blob) // 2], False),
}


@pytest.mark.parametrize("damage", list(OWN_SPACE_DAMAGE))
def test_a_forged_or_damaged_blob_in_the_readers_own_space_is_removed_and_counted(tier, damage):
    make_bad, forged = OWN_SPACE_DAMAGE[damage]
    log = RecordingLog()
    reader, other = tier(seal=S1, log=log), tier(seal=S2)
    reader.put_many(blocks([0, 1]))
    other.put_many(blocks([0]))
    write_blob(reader, key(0), make_bad(read_blob(reader, key(0))))
    assert reader.get_many([key(0), key(1)]) == [None, payload(1)]
    assert read_blob(reader, key(0)) is None  # removed: the block can be written back
    stats = reader.stats()
    assert (stats.corrupt, stats.forged) == (1, int(forged))
    assert [event for event, _ in log.errors] == ["storage.forged" if forged else "storage.corrupt"]
    assert other.get_many([key(0)]) == [payload(0)]  # the other secret's block stays


def test_blobs_sealed_before_the_secret_named_the_key_space_are_not_found_nor_deleted(tier):
    """The layout before namespaces kept sealed blobs where plain ones are: a reader with
    the secret no longer finds them (a miss, no forgery), and leaves them to eviction."""
    plain = tier()
    written_before = encode(FP, key(0), payload(0), S1)
    write_blob(plain, key(0), written_before)
    sealed = tier(seal=S1)
    assert sealed.get_many([key(0)]) == [None]
    assert sealed.stats().corrupt == 0
    assert read_blob(plain, key(0)) == written_before


def test_the_key_formats_name_the_secrets_identifier_and_the_plain_ones_are_unchanged(tmp_path):
    fp, k = FP.hex(), key(0).hex()
    with closing(LocalBackend(tmp_path, fingerprint=FP, seal=S1)) as sealed:
        assert sealed.path_for(key(0)) == str(tmp_path / fp / f"s{S1.id}" / k[:2] / k)
    with closing(LocalBackend(tmp_path, fingerprint=FP)) as plain:
        assert plain.path_for(key(0)) == str(tmp_path / fp / k[:2] / k)


def test_the_redis_key_names_the_secrets_identifier_and_the_plain_one_is_unchanged(redis_url):
    with closing(RedisBackend(redis_url, fingerprint=FP, seal=S1)) as sealed:
        assert sealed.redis_key(key(0)) == f"rf:s{S1.id}:{FP.hex()}:{key(0).hex()}".encode()
    with closing(RedisBackend(redis_url, fingerprint=FP)) as plain:
        assert plain.redis_key(key(0)) == f"rf:{FP.hex()}:{key(0).hex()}".encode()


# --- a rotation under load --------------------------------------------------------------------


def test_a_key_rotation_under_load_loses_no_block_its_holder_can_read(tier):
    """Two writers with the old secret and two with the new one, each on a thread of its own,
    put seeded batches of one pool of blocks (the same prompts served on both sides), while a
    reader of each secret reads seeded batches; then each secret's reader gets back every
    block its side wrote, and nobody met a forgery."""
    seed = 4901
    print(f"seed {seed}")
    rng = random.Random(seed)
    pool, rounds = 96, 24
    plans = {  # client -> its seal, and its batches of block numbers
        name: (seal, [rng.sample(range(pool), rng.randint(1, 8)) for _ in range(rounds)])
        for name, seal in [("w1", S1), ("w2", S1), ("w3", S2), ("w4", S2), ("r1", S1), ("r2", S2)]
    }
    clients = {name: (tier(seal=seal), RecordingLog()) for name, (seal, _) in plans.items()}
    start = threading.Barrier(len(plans), timeout=THREAD_TIMEOUT_S)
    failures: list[BaseException] = []

    def work(name: str) -> None:
        client, batches = clients[name][0], plans[name][1]
        try:
            start.wait()
            for batch in batches:
                if name.startswith("w"):
                    client.put_many(blocks(batch))
                else:
                    for i, got in zip(batch, client.get_many([key(i) for i in batch]), strict=True):
                        assert got in (None, payload(i)), f"{name} read block {i} wrong"
        except BaseException as error:
            failures.append(error)

    threads = [threading.Thread(target=work, args=(name,)) for name in plans]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(THREAD_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads) and failures == []
    for reader, writers in (("r1", ("w1", "w2")), ("r2", ("w3", "w4"))):
        written = sorted({i for w in writers for batch in plans[w][1] for i in batch})
        client = clients[reader][0]
        assert client.get_many([key(i) for i in written]) == [payload(i) for i in written]
    for client, _ in clients.values():
        stats = client.stats()
        assert (stats.corrupt, stats.forged) == (0, 0)


# --- old key spaces age out by the local directory's own eviction --------------------------------


def blocks_payloads(start: int, stop: int) -> list[bytes | None]:
    return [payload(i) for i in range(start, stop)]


def files_of(space: Path) -> int:
    return sum(1 for p in space.glob("??/*") if p.is_file())


def test_a_secret_no_instance_holds_any_more_ages_out_of_a_local_directory_by_its_bound(tmp_path):
    """The bound is the fingerprint's, every key space together, and its eviction takes the
    least recently used blob of any: a new secret's writes push the old secret's out, oldest
    first, as they would push out their own."""
    bound = 10 * BLOB
    old = LocalBackend(tmp_path, fingerprint=FP, max_bytes=bound, seal=S1, fsync=False)
    with closing(old):
        for i in range(8):  # one at a time: eight distinct recency stamps
            old.put_many(blocks([i]))
    new = LocalBackend(tmp_path, fingerprint=FP, max_bytes=bound, seal=S2, fsync=False)
    with closing(new):
        new.put_many(blocks(range(100, 108)))
        assert new.stats().evictions == 6
        assert new.get_many([key(i) for i in range(100, 108)]) == blocks_payloads(100, 108)
    fp_dir = tmp_path / FP.hex()
    assert (files_of(fp_dir / f"s{S1.id}"), files_of(fp_dir / f"s{S2.id}")) == (2, 8)
    with closing(LocalBackend(tmp_path, fingerprint=FP, seal=S1, fsync=False)) as reopened:
        assert reopened.get_many([key(i) for i in range(8)]) == [None] * 6 + blocks_payloads(6, 8)


def test_the_plain_key_space_is_evicted_by_the_same_rule_as_a_sealed_one(tmp_path):
    bound = 4 * BLOB
    with closing(LocalBackend(tmp_path, fingerprint=FP, max_bytes=0, fsync=False)) as plain:
        plain.put_many(blocks(range(4)))
    with closing(
        LocalBackend(tmp_path, fingerprint=FP, max_bytes=bound, seal=S1, fsync=False)
    ) as sealed:
        assert sealed.put_many(blocks(range(10, 14))) == 4
        assert sealed.stats().evictions == 4
    assert files_of(tmp_path / FP.hex()) == 0  # the plain blobs were the oldest
    assert files_of(tmp_path / FP.hex() / f"s{S1.id}") == 4


def test_another_key_spaces_block_used_since_the_scan_is_not_evicted_the_next_oldest_is(tmp_path):
    bound = 20 * BLOB
    old = LocalBackend(tmp_path, fingerprint=FP, max_bytes=0, seal=S1, fsync=False)
    for i in range(20):
        old.put_many(blocks([i]))
    new = LocalBackend(tmp_path, fingerprint=FP, max_bytes=bound, seal=S2, fsync=False)
    with closing(old), closing(new):
        assert new.stats().evictions == 0  # the scan at open: 20 blobs, within the bound
        assert old.get_many([key(0)]) == [payload(0)]  # the oldest is used after that scan
        new.put_many(blocks([100, 101]))  # too little written for a rescan
        assert new.stats().evictions == 1
        assert os.path.exists(old.path_for(key(0)))
        assert not os.path.exists(old.path_for(key(1)))

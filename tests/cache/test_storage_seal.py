"""An untrusted tier: keyed blobs (cache.storage.secret), private directories, redis logins."""

from __future__ import annotations

import hashlib
import os
import stat
from contextlib import closing

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringfence.actors.tools.testing.redis_server import REDIS_SERVER, redis_server
from ringfence.actors.tools.testing.storage import RecordingLog, read_blob, write_blob
from ringfence.cache.config import StorageConfig
from ringfence.cache.ids import BlockHash
from ringfence.cache.storage import FORGED_REPORT_S, Counters, StorageUnavailable
from ringfence.cache.storage.blob import (
    END_BYTES,
    TRAILER,
    CorruptBlock,
    decode,
    decode_into,
    encode,
)
from ringfence.cache.storage.local import LocalBackend
from ringfence.cache.storage.memory import MemoryBackend
from ringfence.cache.storage.private_dir import UnsafeDirectory
from ringfence.cache.storage.redis_backend import RedisBackend
from ringfence.cache.storage.registry import open_backend, open_storage
from ringfence.cache.storage.seal import SECRET_ENV, Seal, load_seal
from ringfence.cache.storage.url import PASSWORD_ENV, redact, split_password
from ringfence.shm.errors import ConfigError

FP = hashlib.blake2b(b"model-a", digest_size=16).digest()
BLOCK = 4096
SECRET = "correct horse battery staple"
SEAL = Seal(SECRET.encode())
OTHER_SEAL = Seal(b"another tier's secret")


def key(i: int) -> BlockHash:
    return BlockHash(hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest())


def payload(i: int, size: int = BLOCK) -> bytes:
    return bytes((i + j) % 251 for j in range(size))


def flip(blob: bytes, at: int) -> bytes:
    return blob[:at] + bytes([blob[at] ^ 0x01]) + blob[at + 1 :]


@pytest.fixture(params=["local", "redis", "memory"])
def make(request, tmp_path):
    """A builder of backends of one kind over one store (memory: each its own), with or
    without a seal; each closed after the test."""
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
            log=log if log is not None else RecordingLog(),
            seal=seal,
        )
        opened.append(backend)
        return backend

    yield build
    for backend in opened:
        backend.close()


# --- keyed blobs -----------------------------------------------------------------------------


def test_a_forged_block_with_a_right_checksum_is_served_without_the_secret_and_missed_with_it(
    make,
):
    forged = encode(FP, key(0), b"\xee" * BLOCK)  # a plain blob under a real key, CRC right
    trusting, log = make(), RecordingLog()
    sealed = make(seal=SEAL, log=log)
    write_blob(trusting, key(0), forged)
    assert trusting.get_many([key(0)]) == [b"\xee" * BLOCK]  # no secret: the CRC is all asked
    write_blob(sealed, key(0), forged)  # (memory: each backend its own store)
    assert sealed.get_many([key(0)]) == [None]
    forged_event = {"backend": sealed.name, "key": key(0).hex(), "count": 1}
    assert log.errors == [("storage.forged", forged_event)]
    stats = sealed.stats()
    assert (stats.hits, stats.misses, stats.corrupt, stats.forged) == (0, 1, 1, 1)
    assert read_blob(sealed, key(0)) is None  # deleted: the real block can be written back
    assert sealed.put_many([(key(0), payload(0))]) == 1
    assert sealed.get_many([key(0)]) == [payload(0)]


def test_a_keyed_block_reads_back_with_the_secret_and_without_it(make):
    sealed = make(seal=SEAL)
    assert sealed.put_many([(key(0), payload(0))]) == 1
    assert len(read_blob(sealed, key(0)) or b"") == BLOCK + END_BYTES
    assert sealed.get_many([key(0)]) == [payload(0)]
    dest = bytearray(BLOCK)
    assert sealed.get_into([(key(0), dest)]) == [True]
    assert bytes(dest) == payload(0)
    trusting = make()
    write_blob(trusting, key(0), encode(FP, key(0), payload(0), SEAL))
    assert trusting.get_many([key(0)]) == [payload(0)]  # its CRC-32 checked


# damage -> where in a keyed blob of one BLOCK-byte payload
KEYED_DAMAGE = {
    "flipped payload byte": lambda blob: flip(blob, BLOCK // 3),
    "flipped tag byte": lambda blob: flip(blob, BLOCK + 5),
    "flipped reserved byte": lambda blob: flip(blob, BLOCK + END_BYTES - TRAILER.size + 6),
    "sealed by another secret": lambda blob: encode(FP, key(0), payload(0), OTHER_SEAL),
    "a plain blob": lambda blob: encode(FP, key(0), payload(0)),
}


@pytest.mark.parametrize("damage", list(KEYED_DAMAGE))
def test_a_keyed_blob_that_does_not_verify_is_a_forged_miss_and_its_buffer_unused(make, damage):
    log = RecordingLog()
    sealed = make(seal=SEAL, log=log)
    sealed.put_many([(key(0), payload(0))])
    blob = KEYED_DAMAGE[damage](read_blob(sealed, key(0)))
    write_blob(sealed, key(0), blob)
    dest = bytearray(b"\x55" * BLOCK)
    assert sealed.get_into([(key(0), dest)]) == [False]
    assert [event for event, _ in log.errors] == ["storage.forged"]
    if sealed.name != "local":  # local reads into the buffer, then checks (module docstring)
        assert dest == b"\x55" * BLOCK
    assert read_blob(sealed, key(0)) is None


def test_the_checksum_byte_a_keyed_reader_ignores_is_still_the_trusting_readers_check():
    blob = encode(FP, key(0), payload(0), SEAL)
    damaged = flip(blob, len(blob) - 8)
    assert decode(FP, key(0), damaged, SEAL) == payload(0)
    with pytest.raises(CorruptBlock) as caught:
        decode(FP, key(0), damaged)
    assert caught.value.reason == "checksum"


@settings(max_examples=200, deadline=None, print_blob=True)
@given(data=st.binary(min_size=0, max_size=300), at=st.integers(min_value=0), bit=st.integers(0, 7))
def test_any_flipped_bit_of_a_keyed_blob_but_its_crc_is_refused_and_dest_stays_untouched(
    data, at, bit
):
    blob = bytearray(encode(FP, key(1), data, SEAL))
    at %= len(blob)
    crc = range(len(blob) - 8, len(blob))  # checksum and padding: the tag does not cover them
    blob[at] ^= 1 << bit
    dest = memoryview(bytearray(b"\x55" * len(data)))
    if at in crc:
        decode_into(FP, key(1), blob, dest, SEAL)
        assert dest == data
        return
    with pytest.raises(CorruptBlock):
        decode_into(FP, key(1), blob, dest, SEAL)
    assert dest == b"\x55" * len(data)


def test_forged_blobs_are_reported_once_per_interval_with_their_count():
    now = [100.0]
    log = RecordingLog()
    counters = Counters("redis", log, clock=lambda: now[0])
    forged = CorruptBlock(key(0), "forged", "")
    for _ in range(3):
        counters.report(forged)
    now[0] += FORGED_REPORT_S
    counters.report(CorruptBlock(key(1), "forged", ""))
    assert log.errors == [
        ("storage.forged", {"backend": "redis", "key": key(0).hex(), "count": 1}),
        ("storage.forged", {"backend": "redis", "key": key(1).hex(), "count": 3}),
    ]
    assert (counters.forged, counters.corrupt) == (4, 4)


# --- the secret and its identifier --------------------------------------------------------------


def test_the_secret_comes_from_the_setting_the_variable_or_a_file_and_two_are_refused(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text(f"# the tier's\n\n{SECRET}\n")
    assert load_seal("", environ={}) is None
    seals = [
        load_seal(SECRET, environ={}),
        load_seal("", environ={SECRET_ENV: SECRET}),
        load_seal("", str(secret_file), environ={}),
        load_seal(SECRET, str(secret_file), environ={SECRET_ENV: SECRET}),
    ]
    assert {seal.id if seal else None for seal in seals} == {SEAL.id}
    with pytest.raises(ValueError, match="2 different secrets") as caught:
        load_seal("another", environ={SECRET_ENV: SECRET})
    assert SECRET not in str(caught.value)
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(ValueError, match="no secret in it"):
        load_seal("", str(tmp_path / "empty"), environ={})


def test_the_secrets_identifier_tells_secrets_apart_and_holds_neither_secret_nor_key():
    assert SEAL.id != OTHER_SEAL.id
    assert SEAL.id == Seal(SECRET.encode()).id
    assert len(SEAL.id) == 32
    assert SECRET not in repr(SEAL) and SECRET.encode().hex() not in SEAL.id


def test_open_storage_takes_the_secret_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    settings = StorageConfig(backend="memory")
    with closing(open_storage(settings, fingerprint=FP, run_dir=tmp_path)) as store:
        store.put_many([(key(0), payload(0))])
        assert isinstance(store, MemoryBackend)
        assert decode(FP, key(0), store.blobs[key(0)], SEAL) == payload(0)
    monkeypatch.setenv(SECRET_ENV, f"{SECRET},another")
    with pytest.raises(ConfigError) as caught:
        open_storage(settings, fingerprint=FP, run_dir=tmp_path)
    assert caught.value.key == "cache.storage.secret"


# --- the local directory is this user's -------------------------------------------------------


def test_local_blobs_are_0600_and_the_directories_it_makes_0700(tmp_path):
    with closing(LocalBackend(tmp_path / "store", fingerprint=FP)) as store:
        store.put_many([(key(0), payload(0))])
        path = store.path_for(key(0))
        modes = [
            stat.S_IMODE(os.stat(p).st_mode)
            for p in (path, os.path.dirname(path), store.directory, tmp_path / "store")
        ]
    assert modes == [0o600, 0o700, 0o700, 0o700]


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o722, 0o1777])
def test_a_storage_directory_others_may_write_is_refused_by_path_and_mode(tmp_path, mode):
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(UnsafeDirectory) as caught:
        LocalBackend(root, fingerprint=FP)
    assert f"{root} (mode {mode:04o})" in str(caught.value)
    assert caught.value.key == "cache.storage.path"
    root.chmod(0o755)  # others may read, not write: taken
    LocalBackend(root, fingerprint=FP).close()
    fp_dir = root / FP.hex()
    fp_dir.chmod(0o757)
    with pytest.raises(UnsafeDirectory, match=str(fp_dir)):
        LocalBackend(root, fingerprint=FP)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory away needs root")
def test_a_storage_directory_of_another_user_is_refused(tmp_path):
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    os.chown(root, 65534, 65534)  # nobody
    with pytest.raises(UnsafeDirectory, match="belongs to user 65534"):
        LocalBackend(root, fingerprint=FP)


# --- redis: a user and a password, never printed -------------------------------------------------


def test_a_password_in_the_url_leaves_it_for_the_password_setting():
    cfg = StorageConfig(backend="redis", url="redis://alice:p%40ss@10.0.0.1:6380/2")
    assert (cfg.url, cfg.password) == ("redis://alice@10.0.0.1:6380/2", "p@ss")
    assert "p@ss" not in repr(cfg) and "p%40ss" not in repr(cfg)
    assert StorageConfig(url="rediss://h:6380/0").url == "rediss://h:6380/0"
    with pytest.raises(ValueError, match=r"cache\.storage\.url"):
        StorageConfig(url="redis://:one@h", password="two")
    assert redact("redis://alice:pw@h:1/0") == "redis://alice:***@h:1/0"
    assert redact("redis://h:1/0") == "redis://h:1/0"
    assert split_password("redis://:pw@h").url == "redis://h"
    # redis-py's other form, in the query string: taken out the same, other options kept.
    cfg = StorageConfig(url="redis://h:1/0?ssl_ca_certs=%2Fca.pem&password=p%26q&db=2")
    assert (cfg.url, cfg.password) == ("redis://h:1/0?ssl_ca_certs=%2Fca.pem&db=2", "p&q")
    unix = StorageConfig(url="unix:///run/redis.sock?password=pw&db=1")
    assert (unix.url, unix.password) == ("unix:///run/redis.sock?db=1", "pw")
    assert redact("redis://h/0?password=pw&db=1") == "redis://h/0?password=***&db=1"
    assert split_password("redis://:one@h/0?password=two") == ("redis://h/0", "one")


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    with redis_server(tmp_path_factory.mktemp("redis-acl"), user=("alice", "s3cret pw")) as url:
        yield url


def test_an_acl_user_logs_in_by_url_or_by_the_password_setting(acl_redis, monkeypatch):
    host = acl_redis.removeprefix("redis://")
    with pytest.raises(StorageUnavailable) as refused:
        open_backend("redis", fingerprint=FP, url=f"redis://alice:wrong@{host}")
    assert "wrong" not in str(refused.value)
    in_url = f"redis://alice:s3cret%20pw@{host}"
    with closing(open_backend("redis", fingerprint=FP, url=in_url)) as store:
        assert store.put_many([(key(0), payload(0))]) == 1
        assert isinstance(store, RedisBackend)
        assert "s3cret" not in store.url
    in_query = f"redis://alice@{host}/0?password=s3cret%20pw"  # redis-py's other form
    with closing(open_backend("redis", fingerprint=FP, url=in_query)) as store:
        assert store.get_many([key(0)]) == [payload(0)]
        assert isinstance(store, RedisBackend) and "s3cret" not in store.url
    monkeypatch.setenv(PASSWORD_ENV, "s3cret pw")
    settings = StorageConfig(backend="redis", url=f"redis://alice@{host}")
    with closing(open_storage(settings, fingerprint=FP, run_dir=None)) as store:
        assert store.get_many([key(0)]) == [payload(0)]


def test_a_tls_redis_is_reached_by_rediss_and_verified_against_the_urls_ca(tmp_path):
    if REDIS_SERVER is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    from certificates import make_certificates

    certs = make_certificates(tmp_path / "certs")
    pair = (certs.server.certfile, certs.server.keyfile, certs.ca)
    with redis_server(tmp_path, tls=pair) as url:
        assert url.startswith("rediss://") and "ssl_ca_certs=" in url
        with closing(open_backend("redis", fingerprint=FP, url=url)) as store:
            assert store.put_many([(key(0), payload(0))]) == 1
            assert store.get_many([key(0)]) == [payload(0)]
        bare = url.partition("?")[0]  # the system's trust store: the test CA is not in it
        with pytest.raises(StorageUnavailable, match="certificate verify failed"):
            open_backend("redis", fingerprint=FP, url=bare)
        plain = bare.replace("rediss://", "redis://")  # no TLS to a TLS-only server
        with pytest.raises(StorageUnavailable):
            open_backend("redis", fingerprint=FP, url=plain)

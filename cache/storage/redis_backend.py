"""The ``redis`` backend: blobs in a Redis server that instances on several machines share.

Each block is one string value (a blob, see blob.py) under a key that names its key space::

    rf:<fingerprint hex>:<key hex>              a plain blob (no storage secret)
    rf:s<secret id>:<fingerprint hex>:<key hex> a blob sealed with the storage secret whose
                                                public identifier is <secret id> (seal.py)

so instances of different models, and instances holding different secrets, share a server
without meeting each other's blocks: a reader never reads, and so never deletes, a blob of
another key space (a key rotation loses nothing that the old secret's holders can still
read), and the old secret's keys age out by the server's eviction, as any other. Sealed
blobs written before the secret named the key (under ``rf:<fingerprint hex>:``) are not
found by a reader with the secret. Every call is one round trip per chunk
of keys (a non-transactional pipeline): ``SET .. NX`` to put (a key already stored
holds the same bytes, so it is left alone), ``GET`` to get, ``EXISTS`` for the
longest prefix, ``UNLINK`` to delete (the server frees memory off its main thread).
A value is written by one command, so readers never see part of one.

Capacity is the server's job, not this client's: give the server ``maxmemory`` and
``maxmemory-policy allkeys-lru``; ``max_bytes`` is not enforced here and
``evictions`` stays 0. ``stats()`` counts this key space's blocks and bytes with a
``SCAN``: it costs time in the number of keys, so keep it off the hot path.

redis is imported when a backend is constructed, never when this module is, so the
package imports without redis installed. Connection failures and timeouts raise
:class:`~ringfence.cache.storage.StorageUnavailable`; other Redis errors (a
misconfigured server) propagate unchanged.

TLS and ACLs: ``url`` may be ``rediss://`` and name a user (``redis://user@host``); the
password is ``password`` (a password in the URL is taken out of it first, cache/storage/url.py),
so the URL this backend keeps and prints (:attr:`url`, errors: host and port) holds none.

Faults: every connect and every reply waits at most ``socket_timeout_s``, and the
client is told to retry nothing itself (redis-py 8's default policy retries ten times
with sleeps in between: a refused connect took 4.7 s per call here, and a server that
stopped answering would cost eleven timeouts): a stopped server fails a call at once,
a hung one after the timeout. A server restarted on the same address needs nothing:
the pool drops a connection the server closed and connects afresh on the next call,
so the first call after the restart succeeds (on an empty server: misses).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final, TypeVar

from ringfence.cache.ids import BlockHash
from ringfence.cache.storage.backend import (
    DEFAULT_TIMEOUT_S,
    StorageLog,
    StorageStats,
    StorageUnavailable,
)
from ringfence.cache.storage.blob import (
    Buffer,
    as_bytes_view,
    check_key,
    encode,
)
from ringfence.cache.storage.counters import Counters, stdlib_log
from ringfence.cache.storage.seal import Seal, namespace
from ringfence.cache.storage.url import split_password

if TYPE_CHECKING:
    import redis

CHUNK_BYTES: Final = 32 << 20  # most value bytes sent in one pipeline
CHUNK_KEYS: Final = 256  # most keys read in one pipeline
SCAN_COUNT: Final = 1000

T = TypeVar("T")


class RedisBackend:
    """Blocks of one fingerprint and one storage secret (or none) in a Redis server.

    Owner: one thread (one connection pool).
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        fingerprint: bytes,
        log: StorageLog | None = None,
        socket_timeout_s: float = DEFAULT_TIMEOUT_S,
        require_server: bool = True,
        seal: Seal | None = None,
        password: str = "",
    ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        check_key(fingerprint, "fingerprint")
        self.fingerprint = fingerprint
        self.seal = seal  # the storage secret's MAC: blobs are keyed and must verify
        space = namespace(seal)
        # Of every key of this backend: its secret's key space, then its fingerprint's.
        self.prefix = f"rf:{space}{':' if space else ''}{fingerprint.hex()}:".encode()
        self._errors: tuple[type[Exception], ...] = (
            redis.exceptions.ConnectionError,
            redis.exceptions.TimeoutError,
        )
        url, in_url = split_password(url)  # a URL is printed: it keeps no password
        self.url = url
        self.client: redis.Redis = redis.Redis.from_url(
            url,
            password=password or in_url or None,
            decode_responses=False,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 0),  # fail fast: see the module docstring
        )
        self._counters = Counters(self.name, log)
        self._closed = False
        try:
            self._call(self.client.ping)  # fail at open, not at the first write-back
        except StorageUnavailable as e:
            if require_server:
                raise
            # The pool connects on a later call once the server is up; until then each
            # call raises StorageUnavailable, which callers turn into misses.
            kwargs = self.client.connection_pool.connection_kwargs
            where = f"{kwargs.get('host', '')}:{kwargs.get('port', '')}"
            (log or stdlib_log()).warning(
                "storage.unreachable", backend=self.name, where=where, error=str(e)
            )

    def redis_key(self, key: BlockHash) -> bytes:
        """The Redis key a block is stored under."""
        check_key(key)
        return self.prefix + key.hex().encode()

    def put_many(self, items: Iterable[tuple[BlockHash, Buffer]]) -> int:
        self._check_open()
        written = 0
        batch: list[tuple[bytes, bytes]] = []
        batch_bytes = 0
        for key, payload in items:
            name = self.redis_key(key)
            blob = encode(self.fingerprint, key, payload, self.seal)
            batch.append((name, blob))
            batch_bytes += len(blob)
            if batch_bytes >= CHUNK_BYTES:
                written += self._set_nx(batch)
                batch, batch_bytes = [], 0
        if batch:
            written += self._set_nx(batch)
        self._counters.num_puts += written
        return written

    def get_many(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        self._check_open()
        counters, fp, seal = self._counters, self.fingerprint, self.seal
        out: list[bytes | None] = []
        for chunk in _chunks(keys, CHUNK_KEYS):
            blobs = self._pipelined(lambda pipe, k: pipe.get(self.redis_key(k)), chunk)
            for key, blob in zip(chunk, blobs, strict=True):
                payload = None
                if blob is not None:
                    payload = counters.payload(fp, key, blob, self._drop, seal=seal)
                self._count(payload is not None)
                out.append(payload)
        return out

    def get_into(self, items: Sequence[tuple[BlockHash, Buffer]]) -> list[bool]:
        self._check_open()
        counters, fp, seal = self._counters, self.fingerprint, self.seal
        out: list[bool] = []
        for chunk in _chunks(items, CHUNK_KEYS):
            blobs = self._pipelined(lambda pipe, item: pipe.get(self.redis_key(item[0])), chunk)
            for (key, buffer), blob in zip(chunk, blobs, strict=True):
                dest = as_bytes_view(buffer)
                hit = blob is not None and counters.fill(fp, key, blob, dest, self._drop, seal=seal)
                self._count(hit)
                out.append(hit)
        return out

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        self._check_open()
        found = 0
        for chunk in _chunks(keys, CHUNK_KEYS):
            present = self._pipelined(lambda pipe, k: pipe.exists(self.redis_key(k)), chunk)
            for exists in present:
                if not exists:
                    return found
                found += 1
        return found

    def delete(self, keys: Iterable[BlockHash]) -> int:
        self._check_open()
        names = [self.redis_key(key) for key in keys]
        removed = 0
        for chunk in _chunks(names, CHUNK_KEYS):
            removed += int(self._call(functools.partial(self.client.unlink, *chunk)))
        return removed

    def stats(self) -> StorageStats:
        """Counters of this client; ``num_blocks``/``num_bytes`` by a SCAN of the server."""
        self._check_open()
        names = self._call(lambda: list(self.client.scan_iter(self.prefix + b"*", SCAN_COUNT)))
        sizes = [0]
        for chunk in _chunks(names, CHUNK_KEYS):
            sizes += self._pipelined(lambda pipe, name: pipe.strlen(name), chunk)
        return self._counters.snapshot(num_blocks=len(names), num_bytes=sum(sizes))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.client.close()

    def _set_nx(self, batch: list[tuple[bytes, bytes]]) -> int:
        done = self._pipelined(lambda pipe, item: pipe.set(item[0], item[1], nx=True), batch)
        return sum(1 for ok in done if ok)

    def _drop(self, key: BlockHash) -> None:
        """Delete a blob that failed its checks (already reported as corrupt)."""
        with contextlib.suppress(*self._errors):
            self.client.unlink(self.redis_key(key))

    def _count(self, hit: bool) -> None:
        if hit:
            self._counters.hits += 1
        else:
            self._counters.misses += 1

    def _pipelined(self, command: Callable[[Any, T], object], args: Sequence[T]) -> list[Any]:
        """One round trip: ``command(pipe, arg)`` for each arg; the replies in order."""

        def run() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for arg in args:
                command(pipe, arg)
            return pipe.execute()

        return self._call(run)

    def _call(self, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except self._errors as error:
            raise StorageUnavailable(f"redis at {self._where()}: {error}") from error

    def _where(self) -> str:
        kwargs = self.client.connection_pool.connection_kwargs
        return str(kwargs.get("path") or f"{kwargs.get('host')}:{kwargs.get('port')}")

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("storage backend 'redis' is closed")


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]

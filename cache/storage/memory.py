"""In-process backends: ``memory`` (a dict of blobs, for tests) and ``none`` (no tier)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from ringfence.cache.ids import BlockHash
from ringfence.cache.storage.backend import StorageLog, StorageStats
from ringfence.cache.storage.blob import (
    Buffer,
    as_bytes_view,
    check_key,
    encode,
)
from ringfence.cache.storage.counters import Counters
from ringfence.cache.storage.seal import Seal


class MemoryBackend:
    """Blobs in an ordered dict, checked exactly as the other backends check theirs.

    It stores encoded blobs, not payloads, so the tests that run against it exercise
    the same header and checksum code as ``local`` and ``redis``. The dict is ordered
    least recently used first (a hit moves its key to the end), which is all an LRU
    needs. Owner: one thread; nothing is shared between processes.
    """

    name = "memory"

    def __init__(
        self,
        *,
        fingerprint: bytes,
        max_bytes: int = 0,
        log: StorageLog | None = None,
        seal: Seal | None = None,
    ):
        check_key(fingerprint, "fingerprint")
        self.fingerprint = fingerprint
        self.seal = seal  # the storage secret's MAC: blobs are keyed and must verify
        self.max_bytes = max_bytes  # 0: no bound
        # The stored blobs, least recently used first; read-only outside (see replace_blob).
        self.blobs: OrderedDict[BlockHash, bytes] = OrderedDict()
        self._num_bytes = 0
        self._counters = Counters(self.name, log)
        self._closed = False

    def put_many(self, items: Iterable[tuple[BlockHash, Buffer]]) -> int:
        self._check_open()
        written = 0
        for key, payload in items:
            check_key(key)
            if key in self.blobs:
                continue
            blob = encode(self.fingerprint, key, payload, self.seal)
            self.blobs[key] = blob
            self._num_bytes += len(blob)
            written += 1
        self._counters.num_puts += written
        self._evict()
        return written

    def get_many(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        self._check_open()
        fp = self.fingerprint
        out: list[bytes | None] = []
        for key in keys:
            check_key(key)
            blob = self.blobs.get(key)
            payload = (
                None
                if blob is None
                else self._counters.payload(fp, key, blob, self._remove, seal=self.seal)
            )
            if payload is None:
                self._counters.misses += 1
            else:
                self._counters.hits += 1
                self.blobs.move_to_end(key)
            out.append(payload)
        return out

    def get_into(self, items: Sequence[tuple[BlockHash, Buffer]]) -> list[bool]:
        self._check_open()
        fp = self.fingerprint
        out: list[bool] = []
        for key, buffer in items:
            check_key(key)
            blob = self.blobs.get(key)
            dest = as_bytes_view(buffer)
            hit = blob is not None and self._counters.fill(
                fp, key, blob, dest, self._remove, seal=self.seal
            )
            if hit:
                self._counters.hits += 1
                self.blobs.move_to_end(key)
            else:
                self._counters.misses += 1
            out.append(hit)
        return out

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        self._check_open()
        for i, key in enumerate(keys):
            check_key(key)
            if key not in self.blobs:
                return i
        return len(keys)

    def delete(self, keys: Iterable[BlockHash]) -> int:
        self._check_open()
        return sum(self._remove(key) for key in keys)

    def stats(self) -> StorageStats:
        return self._counters.snapshot(num_blocks=len(self.blobs), num_bytes=self._num_bytes)

    def close(self) -> None:
        self._closed = True

    def replace_blob(self, key: BlockHash, blob: bytes) -> None:
        """Store ``blob`` under ``key`` as it is, unchecked (for tests that tamper)."""
        self._remove(key)
        self.blobs[key] = blob
        self._num_bytes += len(blob)

    def _remove(self, key: BlockHash) -> bool:
        check_key(key)
        blob = self.blobs.pop(key, None)
        if blob is None:
            return False
        self._num_bytes -= len(blob)
        return True

    def _evict(self) -> None:
        while self.max_bytes and self._num_bytes > self.max_bytes:
            self._remove(next(iter(self.blobs)))
            self._counters.evictions += 1

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("storage backend 'memory' is closed")


class NullBackend:
    """No storage tier (``cache.storage.backend = "none"``): stores nothing, finds nothing."""

    name = "none"

    def __init__(self) -> None:
        self._counters = Counters(self.name, None)

    def put_many(self, items: Iterable[tuple[BlockHash, Buffer]]) -> int:
        for key, _ in items:
            check_key(key)
        return 0

    def get_many(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        for key in keys:
            check_key(key)
        self._counters.misses += len(keys)
        return [None] * len(keys)

    def get_into(self, items: Sequence[tuple[BlockHash, Buffer]]) -> list[bool]:
        for key, _ in items:
            check_key(key)
        self._counters.misses += len(items)
        return [False] * len(items)

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        return 0

    def delete(self, keys: Iterable[BlockHash]) -> int:
        return 0

    def stats(self) -> StorageStats:
        return self._counters.snapshot(num_blocks=0, num_bytes=0)

    def close(self) -> None:
        pass

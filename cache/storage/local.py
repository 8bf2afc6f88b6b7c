"""The ``local`` backend: one file per block in a directory that processes may share.

Layout under the root directory (<fp>: the writer's fingerprint in hex; <k0>: the key's
first byte in hex; the files themselves are blob_files.py's)::

    <root>/<fp>/<k0>/<key hex>          a plain blob (see blob.py; no storage secret)
    <root>/<fp>/s<id>/<k0>/<key hex>    a blob sealed with the storage secret whose public
                                        identifier is <id> (seal.py)

Each fingerprint and each storage secret (or none) has its own key space, the backend's
``directory``: the ranks of one instance store their shards of a block under one key, each
under its own fingerprint (docs/design.md, "Ranks (tensor parallelism)"), and so do models
sharing a root; instances holding different secrets (a misconfigured one, both sides of a
key rotation) store the same key side by side. A backend reads only its key space, so it
never deletes a blob it cannot verify because another secret sealed it. Sealed blobs written
before the secret named the directory (right under ``<root>/<fp>/<k0>``) are not found by a
reader with the secret; blocks left directly under ``<root>/<k0>`` by an older layout are
never read, nor removed.

Eviction, by least recent use: each process keeps an index of the blocks it knows
(an ordered dict, least recently used first, with each blob's size). A put and a
hit also set the file's mtime to ``time.time_ns()``, so a scan of the directory,
which orders by mtime, reproduces every process's uses in one order. The index is
built by a scan on open and rebuilt by one whenever this process has written
``max_bytes / 8`` since the last, so it learns of other processes' blocks. The bound is
the fingerprint's, all its key spaces together: a scan also lists the other key spaces
under ``<root>/<fp>`` (:class:`~.blob_index.ForeignBlobs`), and the backend evicts the
oldest blob of any of them while their total exceeds ``max_bytes``, so the key space of a
secret no instance holds any more ages out by the one rule. The fingerprint's directory
may thus exceed ``max_bytes`` by about ``max_bytes / 8`` per writing process between scans.
A block that another process evicted is a miss here and leaves the index; another key
space's block that was used since the scan is not evicted.
A corrupt blob is deleted when found; if another process had just renamed a good
copy over it, that copy goes too, which costs a miss, never wrong data.

Faults: a block that cannot be written leaves nothing visible (blob_files.py). The other
blocks of the put are written, then the put logs ``storage.write_failed`` and raises
:class:`~ringfence.cache.storage.StorageWriteFailed`, so the store lane reports the
write-back failed and the engine forgets its keys. On ``ENOSPC`` or ``EDQUOT`` the
put first evicts least recently used blocks as large as the blocks that failed,
so the next write-back finds room: a directory smaller than ``max_bytes`` keeps
working as a cache instead of staying full. A read that raises an ``OSError`` (not a
missing file) is a miss, logged ``storage.read_failed``.

Permissions: the directory is one user's; a root or fingerprint directory anyone else may
write to is refused at open (:mod:`.private_dir`).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Final, TypeVar

from ringfence.cache.ids import BlockHash
from ringfence.cache.storage.backend import StorageLog, StorageStats, StorageWriteFailed
from ringfence.cache.storage.blob import Buffer, as_bytes_view, check_key
from ringfence.cache.storage.blob_files import BlobFiles, Loaded, Stored
from ringfence.cache.storage.blob_index import BlobIndex, ForeignBlobs
from ringfence.cache.storage.counters import Counters
from ringfence.cache.storage.private_dir import make_private_dir
from ringfence.cache.storage.seal import Seal, namespace

RESCAN_FRACTION: Final = 8  # rescan after writing max_bytes / RESCAN_FRACTION
_FULL: Final = frozenset({errno.ENOSPC, errno.EDQUOT})  # errors that more room would cure
T = TypeVar("T")
R = TypeVar("R")


class LocalBackend:
    """Blocks as files under ``root``, in the key space of ``fingerprint`` and ``seal``; see
    the module docstring for layout and eviction.

    Owner: one thread. A call with several blocks does their file I/O and checksums
    on up to ``num_threads`` pool threads (both release the GIL), so flushes overlap
    each other and checksums overlap reads; the index and counters are updated by
    the calling thread only. Measured on 2 CPUs, 64 blocks of 256 KiB: puts with
    fsync went from 0.43x to 0.69x of a plain ``open().write()``, gets from 0.6x to
    0.7x of a plain ``read()``.
    """

    name = "local"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fingerprint: bytes,
        max_bytes: int = 0,
        log: StorageLog | None = None,
        fsync: bool = True,
        num_threads: int = 4,
        seal: Seal | None = None,
    ) -> None:
        check_key(fingerprint, "fingerprint")
        self.root = os.fspath(root)
        self.fingerprint = fingerprint
        self.seal = seal  # the storage secret's MAC: blobs are keyed and must verify
        fp_dir = os.path.join(self.root, fingerprint.hex())
        self.fingerprint_dir = fp_dir  # every key space of the fingerprint
        space = namespace(seal)  # "": the plain key space is the fingerprint's directory itself
        self.directory = os.path.join(fp_dir, space) if space else fp_dir  # this key space
        self.max_bytes = max_bytes  # 0: no bound
        # Its blob files (tests replace it with files whose writes fail).
        self.files = BlobFiles(self.directory, fingerprint=fingerprint, seal=seal, fsync=fsync)
        self._num_threads = num_threads
        self._pool: ThreadPoolExecutor | None = None
        self._counters = Counters(self.name, log)
        self._index = BlobIndex()  # what the directory holds, least recently used first
        self._foreign = ForeignBlobs()  # the fingerprint's other key spaces, oldest first
        self._written_since_scan = 0
        self._last_stamp = 0
        self._closed = False
        for directory in dict.fromkeys((self.root, self.fingerprint_dir, self.directory)):
            make_private_dir(directory)
        self.rescan()
        self._bound()

    def path_for(self, key: BlockHash) -> str:
        """The file a key is stored in under this fingerprint (whether or not it exists)."""
        return self.files.path_for(key)

    def put_many(self, items: Iterable[tuple[BlockHash, Buffer]]) -> int:
        self._check_open()
        jobs = [(key, as_bytes_view(payload)) for key, payload in items]
        for key, _ in jobs:
            check_key(key)
        # Stamped here, in order, so the mtimes keep the order of the items.
        views = [(key, view, self._stamp()) for key, view in jobs]
        results = self._map(self.files.store, views)
        written = 0
        failed = [stored for stored in results if stored.failed is not None]
        for (key, _, stamp), stored in zip(views, results, strict=True):
            if stored.failed is not None:
                continue
            self._index.remember(key, stored.size, stamp)
            if stored.written:
                self._written_since_scan += stored.size
                written += 1
        self._counters.num_puts += written
        if self.max_bytes and self._written_since_scan * RESCAN_FRACTION >= self.max_bytes:
            self.rescan()
        self._bound()
        if failed:
            self._fail_put(failed, written)
        return written

    def get_many(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        self._check_open()
        loaded = self._load_many([(key, None) for key in keys])
        return [got.payload for got in loaded]

    def get_into(self, items: Sequence[tuple[BlockHash, Buffer]]) -> list[bool]:
        self._check_open()
        loaded = self._load_many([(key, as_bytes_view(buffer)) for key, buffer in items])
        return [got.hit for got in loaded]

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        self._check_open()
        for i, key in enumerate(keys):
            check_key(key)
            if not os.path.exists(self.path_for(key)):  # the index may be stale; the file is not
                return i
        return len(keys)

    def delete(self, keys: Iterable[BlockHash]) -> int:
        self._check_open()
        removed = 0
        for key in keys:
            check_key(key)
            removed += self._unlink(key)
        return removed

    def stats(self) -> StorageStats:
        """Counters of this backend; ``num_blocks``/``num_bytes`` as of its index."""
        return self._counters.snapshot(num_blocks=len(self._index), num_bytes=self._index.num_bytes)

    def close(self) -> None:
        self._closed = True
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def rescan(self) -> None:
        """Rebuild the index from this key space's directory and the list of the
        fingerprint's other key spaces, and remove temp files of dead processes in them
        (other fingerprints' directories are not looked at)."""
        self._index = BlobIndex.scan(self.directory)
        self._foreign = ForeignBlobs.scan(self.fingerprint_dir, own=self.directory)
        self._written_since_scan = 0

    def _fail_put(self, failed: list[Stored], written: int) -> None:
        """Count and log the blocks a put could not write, make room if the disk is full,
        and raise :class:`StorageWriteFailed`."""
        first = failed[0].failed
        assert first is not None
        self._counters.failed_puts += len(failed)
        self._counters.log.error(
            "storage.write_failed",
            backend=self.name,
            failed=len(failed),
            written=written,
            error=str(first),
        )
        full = [s for s in failed if s.failed is not None and s.failed.errno in _FULL]
        if full:
            self._make_room(sum(s.size for s in full))
        raise StorageWriteFailed(
            first.errno,
            f"{len(failed)} of {len(failed) + written} new blocks not written under "
            f"{self.directory}: {first}",
            failed=len(failed),
            written=written,
        )

    def _make_room(self, num_bytes: int) -> None:
        """Evict least recently used blocks of at least ``num_bytes`` in all (a full disk)."""
        freed = 0
        while freed < num_bytes and (size := self._evict_oldest()) is not None:
            freed += size

    def _load_many(self, items: list[tuple[BlockHash, memoryview | None]]) -> list[Loaded]:
        """Load each key (into its buffer, if it has one), then count, index and report."""
        for key, _ in items:
            check_key(key)
        stamped = [(key, dest, self._stamp()) for key, dest in items]
        loaded = self._map(self.files.load, stamped)
        for (key, _, stamp), got in zip(stamped, loaded, strict=True):
            if got.error is not None:
                self._counters.report(got.error)
                self._unlink(key)
            if got.io_error is not None:
                self._counters.read_errors += 1
                self._counters.log.error(
                    "storage.read_failed", backend=self.name, key=key.hex(), error=str(got.io_error)
                )
            if got.hit:
                self._counters.hits += 1
                self._index.remember(key, got.size, stamp)
            else:
                self._counters.misses += 1
                self._index.forget(key)
        return loaded

    def _map(self, fn: Callable[[T], R], items: list[T]) -> list[R]:
        """``fn`` over ``items``, on the pool when there are several (results in order)."""
        if self._num_threads <= 1 or len(items) <= 1:
            return [fn(item) for item in items]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._num_threads, thread_name_prefix="rf-local")
        return list(self._pool.map(fn, items))

    def _stamp(self) -> int:
        """A recency stamp for an mtime: ns since the epoch, increasing within this backend."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        return self._last_stamp

    def _unlink(self, key: BlockHash) -> bool:
        self._index.forget(key)
        return self.files.unlink(key)

    def _bound(self) -> None:
        """Evict while the fingerprint's key spaces together hold more than ``max_bytes``."""
        while self.max_bytes and self._index.num_bytes + self._foreign.num_bytes > self.max_bytes:
            if self._evict_oldest() is None:
                break  # nothing left to evict (unreachable: bytes are held, so blobs are)

    def _evict_oldest(self) -> int | None:
        """Evict the least recently used blob of any of the fingerprint's key spaces (one
        rule for all, so none is exempt); its bytes, or None when none is known."""
        own, other = self._index.oldest(), self._foreign.oldest()
        if other is not None and (own is None or other.stamp <= own.stamp):
            if not self._foreign.evict_oldest():
                return 0  # used since the scan, or gone: nothing freed, and it leaves the list
            self._counters.evictions += 1
            return other.size
        if own is None or own.key is None:
            return None
        self._unlink(own.key)
        self._counters.evictions += 1
        return own.size

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("storage backend 'local' is closed")

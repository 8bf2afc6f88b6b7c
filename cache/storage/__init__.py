"""Storage backends: the tier below host memory, where blocks are kept by content key.

A backend maps a :data:`~ringfence.cache.ids.BlockHash` to a block's bytes. Keys are
content hashes, so writing a key twice stores the same bytes and write-back and
prefetch are idempotent. Every value is stored as a blob (see :mod:`.blob`): the
block's bytes and a trailer naming the format version, the writer's fingerprint, the
key, the length and a checksum, and with a storage secret (:mod:`.seal`) a keyed tag; a
blob that is short, corrupt, from another fingerprint or (with the secret) not sealed by
it reads as a miss, is reported as a ``storage.corrupt`` or ``storage.forged`` error and
is deleted, never returned as data.

A backend's key space is its fingerprint's: backends of two fingerprints sharing one
directory or server store the same key side by side, each sees only its own blocks,
and bounds, evicts and counts only those. So the ranks of one instance, which store
their shards of a block under its key and each its own fingerprint, never collide;
the engine asks all of them through :class:`~.ranks.AllRanks`.

Helpers for tests (a recording log, raw access to stored blobs) are a tool, in
:mod:`ringfence.actors.tools.testing.storage`.

Faults: a backend never turns a fault into data. A read that fails (an I/O error, a
server gone) is a miss or raises; a write that fails raises
:class:`StorageWriteFailed` (local) or :class:`StorageUnavailable` (redis) after
removing what it left half-written, so the caller reports the write-back failed.
:class:`~.guarded.GuardedBackend` wraps the engine's client so that its presence
questions never raise: an unreachable tier answers "nothing stored" until a retry
after a back-off finds it again.

Backends, registered by name in :mod:`.registry` (``cache.storage.backend``), where
:func:`~.registry.open_storage` opens the one a run's settings name:

- ``local`` (:mod:`.local`): one file per block in a directory, bounded by
  ``max_bytes`` with LRU eviction; several processes may share the directory.
- ``redis`` (:mod:`.redis_backend`): a Redis server that instances on several
  machines share; importing this package does not import redis.
- ``memory`` (:mod:`.memory`): a dict, for tests, through the same blob checks.
- ``none``: no storage tier: nothing is stored and every lookup misses.

Log events, all with the field ``backend`` (the name above), and ``tp_rank`` where the
engine's client of one rank logs them (:class:`~.ranks.RankLog`):

- ``storage.corrupt`` (error; ``key`` hex, ``reason`` a :class:`~.blob.CorruptBlock`
  reason): a blob failed its checks; it was treated as a miss and deleted.
- ``storage.forged`` (error; ``key`` hex of the latest, ``count`` since the last report):
  a reader holding the storage secret (:mod:`.seal`) found a blob whose tag does not verify,
  or a plain one; it was treated as a miss and deleted. Reported at most once per
  :data:`FORGED_REPORT_S` per backend with the count since the last report, so whoever can
  write to the tier cannot flood the log (``stats().forged`` counts every one).
- ``storage.read_failed`` (error; ``key``, ``error``): reading a blob raised an
  ``OSError`` (local); it was treated as a miss and left in place.
- ``storage.write_failed`` (error; ``failed``, ``written``, ``error``): a put could not
  write ``failed`` blocks (local: a full disk, a quota, an I/O error); nothing of them
  is visible, and the put raised :class:`StorageWriteFailed`.
- ``storage.unavailable`` (warning; ``error``, ``retry_s``) and ``storage.restored``
  (info; ``outage_s``, ``failures``): :class:`~.guarded.GuardedBackend` lost the tier,
  once per outage, and found it again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Protocol

from ringfence.cache.ids import BlockHash
from ringfence.cache.storage.blob import Buffer, CorruptBlock, decode, decode_into
from ringfence.cache.storage.seal import Seal
from ringfence.shm.errors import RingfenceError

__all__ = [
    "Buffer",
    "CorruptBlock",
    "StorageBackend",
    "StorageLog",
    "StorageStats",
    "StorageUnavailable",
    "StorageWriteFailed",
]


DEFAULT_TIMEOUT_S: Final = 2.0  # a redis client's connect and reply timeout
FORGED_REPORT_S: Final = 10.0  # the least time between two storage.forged events of a backend


class StorageUnavailable(RingfenceError, ConnectionError):
    """The storage server could not be reached or failed mid-request (redis)."""


class StorageWriteFailed(RingfenceError, OSError):
    """A put could not write some blocks (local: a full disk, a quota, an I/O error).

    The blocks it names are not visible (their temp files are removed); the others of
    the same put were written. ``errno`` is that of the first failure.
    """

    def __init__(self, errno: int | None, message: str, *, failed: int, written: int) -> None:
        super().__init__(errno, message)
        self.failed = failed  # blocks of the put that were not written
        self.written = written  # blocks of the put that were


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StorageStats:
    """A snapshot of one backend's counters, taken by :meth:`StorageBackend.stats`."""

    num_blocks: int  # blocks stored (local: as this process last saw the directory)
    num_bytes: int  # bytes of those blobs, headers included
    num_puts: int  # blocks this backend wrote (keys already present are skipped, not counted)
    hits: int  # keys get_many returned data for
    misses: int  # keys get_many returned None for, corrupt ones included
    corrupt: int  # blobs that failed their checks (each also counts as a miss)
    evictions: int  # blocks this backend deleted to stay within max_bytes (or a full disk)
    failed_puts: int = 0  # blocks a put could not write (each put with one raised)
    read_errors: int = 0  # reads that raised an OSError (each also counts as a miss)
    forged: int = 0  # of the corrupt blobs, those whose tag did not verify (or had none)


class StorageLog(Protocol):
    """Where a backend reports faults; an actor's log (or a structlog logger) fits as it is."""

    def error(self, event: str, **fields: object) -> None: ...

    def warning(self, event: str, **fields: object) -> None: ...

    def info(self, event: str, **fields: object) -> None: ...


class _StdlibLog:
    """The default :class:`StorageLog`: the ``logging`` logger ``ringfence.cache.storage``."""

    def __init__(self) -> None:
        self._logger = logging.getLogger(__name__)

    def error(self, event: str, **fields: object) -> None:
        self._emit(logging.ERROR, event, fields)

    def warning(self, event: str, **fields: object) -> None:
        self._emit(logging.WARNING, event, fields)

    def info(self, event: str, **fields: object) -> None:
        self._emit(logging.INFO, event, fields)

    def _emit(self, level: int, event: str, fields: dict[str, object]) -> None:
        text = " ".join(f"{name}={value}" for name, value in fields.items())
        self._logger.log(level, "%s %s", event, text, extra={"event": event, "fields": fields})


def stdlib_log() -> StorageLog:
    """The log a backend reports to when it is given none."""
    return _StdlibLog()


class StorageBackend(Protocol):
    """A storage tier. Owner: one thread of one process (the Transfer actor's store lane).

    Keys are 16-byte :data:`BlockHash` digests (anything else raises ``ValueError``).
    Payloads may be any contiguous buffer; a backend never keeps a reference to one.
    Methods other than ``close`` and ``stats`` raise ``ValueError`` after ``close``.
    """

    name: str  # the registry name: "local", "redis", "memory" or "none"

    def put_many(self, items: Iterable[tuple[BlockHash, Buffer]]) -> int:
        """Store each block; returns how many were written.

        A key that is already stored may be skipped (it holds the same bytes), so a
        repeated write-back is cheap. A block becomes visible only when it is whole.
        """
        ...

    def get_many(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        """The payload of each key, or None for a miss; one entry per key, in order.

        A blob that fails its checks is a miss: it is reported (``storage.corrupt``),
        counted and deleted. A hit refreshes the key's recency for eviction.
        """
        ...

    def get_into(self, items: Sequence[tuple[BlockHash, Buffer]]) -> list[bool]:
        """Read each key's payload straight into its buffer; True where it was a hit.

        The zero-allocation form of :meth:`get_many` for a reader that owns its
        destination (a host KV block): a buffer must be writable, contiguous and
        exactly the payload's size, else ``ValueError``. Where the answer is False
        the buffer holds unspecified bytes (a corrupt blob may have been read into
        it). Misses, corrupt blobs and recency are handled as in :meth:`get_many`.
        """
        ...

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        """How many leading ``keys`` are stored (0 if the first is not).

        Looks at presence only, not payloads, and changes nothing (no recency): a
        corrupt blob counts as present here and reads as a miss in :meth:`get_many`,
        so a prefetch planned from this answer can still fail and be recomputed.
        """
        ...

    def delete(self, keys: Iterable[BlockHash]) -> int:
        """Remove each key; returns how many were stored."""
        ...

    def stats(self) -> StorageStats:
        """A snapshot of the counters; does not change them."""
        ...

    def close(self) -> None:
        """Release files, threads and connections. Idempotent."""
        ...


class Counters:
    """The mutable counters behind :class:`StorageStats`, and the corrupt-blob report.

    Shared by every backend so they count and report the same way.
    """

    __slots__ = (
        "_clock",
        "_forged_reported_at",
        "_forged_unreported",
        "backend",
        "corrupt",
        "evictions",
        "failed_puts",
        "forged",
        "hits",
        "log",
        "misses",
        "num_puts",
        "read_errors",
    )

    def __init__(
        self,
        backend: str,
        log: StorageLog | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend  # the registry name, written in every report
        self.log: StorageLog = log if log is not None else _StdlibLog()
        self.num_puts = 0
        self.hits = 0
        self.misses = 0
        self.corrupt = 0
        self.evictions = 0
        self.failed_puts = 0
        self.read_errors = 0
        self.forged = 0
        self._clock = clock  # times the forged reports
        self._forged_unreported = 0  # forged blobs found since the last storage.forged
        self._forged_reported_at: float | None = None  # the clock at that report

    def report(self, error: CorruptBlock) -> None:
        """Count and log a blob that failed its checks (the caller turns it into a miss).

        A forged one is logged as ``storage.forged``, at most once per
        :data:`FORGED_REPORT_S` with the count since the last (see the module docstring).
        """
        self.corrupt += 1
        if error.reason != "forged":
            self.log.error(
                "storage.corrupt", backend=self.backend, key=error.key.hex(), reason=error.reason
            )
            return
        self.forged += 1
        self._forged_unreported += 1
        now = self._clock()
        last = self._forged_reported_at
        if last is None or now - last >= FORGED_REPORT_S:
            self.log.error(
                "storage.forged",
                backend=self.backend,
                key=error.key.hex(),
                count=self._forged_unreported,
            )
            self._forged_unreported = 0
            self._forged_reported_at = now

    def payload(
        self,
        fingerprint: bytes,
        key: BlockHash,
        blob: Buffer,
        drop: Callable[[BlockHash], object],
        *,
        seal: Seal | None = None,
    ) -> bytes | None:
        """The payload of ``blob``; or, for a blob that fails its checks, report it, ``drop``
        it (so a later write-back can store it again) and return None: a miss."""
        try:
            return decode(fingerprint, key, blob, seal)
        except CorruptBlock as error:
            self.report(error)
            drop(key)
            return None

    def fill(
        self,
        fingerprint: bytes,
        key: BlockHash,
        blob: Buffer,
        dest: memoryview,
        drop: Callable[[BlockHash], object],
        *,
        seal: Seal | None = None,
    ) -> bool:
        """As :meth:`payload`, into ``dest`` (untouched on a miss); True on a hit."""
        try:
            decode_into(fingerprint, key, blob, dest, seal)
        except CorruptBlock as error:
            self.report(error)
            drop(key)
            return False
        return True

    def snapshot(self, *, num_blocks: int, num_bytes: int) -> StorageStats:
        return StorageStats(
            num_blocks=num_blocks,
            num_bytes=num_bytes,
            num_puts=self.num_puts,
            hits=self.hits,
            misses=self.misses,
            corrupt=self.corrupt,
            evictions=self.evictions,
            failed_puts=self.failed_puts,
            read_errors=self.read_errors,
            forged=self.forged,
        )

"""The counters every backend keeps, and how every backend reports a blob that failed its
checks (to its :class:`~.backend.StorageLog`, by default the stdlib logger).

Shared by every backend so they count and report the same way: a corrupt blob is a
``storage.corrupt`` error, each time; a forged one a ``storage.forged`` error at most once per
:data:`FORGED_REPORT_S` with the count since the last report, so whoever can write to the tier
cannot flood the log (``stats().forged`` counts every one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

from ringfence.cache.ids import BlockHash
from ringfence.cache.storage.backend import StorageLog, StorageStats
from ringfence.cache.storage.blob import Buffer, CorruptBlock, decode, decode_into
from ringfence.cache.storage.seal import Seal

FORGED_REPORT_S: Final = 10.0  # the least time between two storage.forged events of a backend


class _StdlibLog:
    """The default :class:`StorageLog`: the ``logging`` logger ``ringfence.cache.storage``."""

    def __init__(self) -> None:
        self._logger = logging.getLogger("ringfence.cache.storage")

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
        self.log: StorageLog = log if log is not None else stdlib_log()
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

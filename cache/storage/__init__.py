"""Storage: the tier below host memory, where blocks are kept by content key.

A face: the names below are re-exported from the modules that define them. Where things
live:

- :mod:`.backend`: the contract every backend keeps (:class:`StorageBackend`, its duties
  in the module docstring), :class:`StorageStats`, :class:`StorageLog` (where a backend
  reports) and the errors, :class:`StorageUnavailable` and :class:`StorageWriteFailed`.
- :mod:`.blob`: a stored value's byte layout and checks; :mod:`.seal`: the storage secret,
  whose public identifier names its blobs' key space in a shared tier.
- :mod:`.counters`: the counters and the corrupt-blob report every backend shares.
- :mod:`.registry`: the backends by name (``cache.storage.backend``) and
  :func:`~.registry.open_storage`, the one way a run opens its tier.
- The backends: ``local`` (:mod:`.local`: one file per block in a directory, bounded by
  ``max_bytes`` with LRU eviction; several processes may share it; its files, each written
  atomically and read checked, are :mod:`.blob_files`'), ``redis``
  (:mod:`.redis_backend`: a server that instances on several machines share; importing this
  package does not import redis), ``memory`` (:mod:`.memory`: a dict, for tests, through the
  same blob checks) and ``none`` (no tier: nothing is stored, every lookup misses).
- :mod:`.guarded`: the engine's client, whose presence questions never raise;
  :mod:`.ranks`: the clients of every rank of an instance, asked as one.

Helpers for tests (a recording log, raw access to stored blobs) are a tool, in
:mod:`ringfence.actors.tools.testing.storage`. The log events (``storage.corrupt``,
``storage.forged``, ``storage.read_failed``, ``storage.write_failed``,
``storage.unavailable``, ``storage.unreachable``, ``storage.restored``; every one with the
field ``backend``, and ``tp_rank`` where the engine's client of one rank logs them,
:class:`~.ranks.RankLog`) are documented in the event catalogue,
``ringfence.runtime.events``.
"""

from __future__ import annotations

from ringfence.cache.storage.backend import (
    DEFAULT_TIMEOUT_S,
    StorageBackend,
    StorageLog,
    StorageStats,
    StorageUnavailable,
    StorageWriteFailed,
)
from ringfence.cache.storage.blob import Buffer, CorruptBlock
from ringfence.cache.storage.counters import FORGED_REPORT_S, Counters, stdlib_log

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "FORGED_REPORT_S",
    "Buffer",
    "CorruptBlock",
    "Counters",
    "StorageBackend",
    "StorageLog",
    "StorageStats",
    "StorageUnavailable",
    "StorageWriteFailed",
    "stdlib_log",
]

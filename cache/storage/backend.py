"""The storage contract: what every backend of the tier below host memory must do.

A backend maps a :data:`~ringfence.cache.ids.BlockHash` to a block's bytes. Its duties,
which ``local``, ``redis`` and ``memory`` each keep and the tests of ``tests/cache`` check
against all of them:

- **Content keys.** Keys are 16-byte content hashes, so writing a key twice stores the
  same bytes: a put may skip a key that is stored, and write-back and prefetch are
  idempotent. Anything else as a key raises ``ValueError``.
- **Whole or absent.** A block becomes visible only when it is whole; a reader never
  sees part of one.
- **Checked blobs.** Every value is stored as a blob (:mod:`.blob`): the block's bytes
  and a trailer naming the format version, the writer's fingerprint, the key, the length
  and a checksum, and with a storage secret (:mod:`.seal`) a keyed tag. A blob that is
  short, corrupt, from another fingerprint or (with the secret) not sealed by it reads as
  a miss, is counted and reported (``storage.corrupt``, ``storage.forged``) and deleted:
  never returned as data.
- **One key space per fingerprint and storage secret.** Backends of two fingerprints, or of
  two secrets (:func:`~.seal.namespace`: the secret's public identifier, or none), sharing
  one directory or server store the same key side by side, and each reads only its own.
  The ranks of one instance, which store their shards of a block under its key and each its
  own fingerprint, never collide (:class:`~.ranks.AllRanks` asks all of them).
- **Never destroy what you cannot verify.** A reader deletes a blob that fails its checks
  only in its own key space, where such a blob is a forgery or damage; it never reads, and
  so never deletes, another secret's blob, which it cannot tell from a forgery. A key
  rotation (instances of the old secret beside those of the new) thus loses no block that
  its holder can still read.
- **Eviction is the tier's.** A bounded tier evicts every key space by one rule, none
  exempt, so the key space of a secret no instance holds any more ages out: ``local`` by
  least recent use over all the key spaces of a fingerprint, ``redis`` by the server's
  ``maxmemory-policy``, ``memory`` holds one key space.
- **Faults are never data.** A read that fails (an I/O error, a server gone) is a miss or
  raises; a write that fails raises :class:`StorageWriteFailed` (local) or
  :class:`StorageUnavailable` (redis) after removing what it left half-written,
  so the caller reports the write-back failed.
- **Counters.** :meth:`StorageBackend.stats` snapshots the counters of
  :class:`StorageStats`, kept by :class:`~.counters.Counters`.
- **One owner.** A backend is used by one thread of one process (the Transfer actor's
  store lane, or the engine's presence questions through :class:`~.guarded.GuardedBackend`);
  several processes may share the tier behind it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Final, Protocol

from ringfence.cache.ids import BlockHash
from ringfence.cache.storage.blob import Buffer
from ringfence.shm.errors import RingfenceError

DEFAULT_TIMEOUT_S: Final = 2.0  # a networked backend's connect and reply timeout (redis)


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


class StorageLog(Protocol):
    """Where a backend reports faults; an actor's log (or a structlog logger) fits as it is."""

    def error(self, event: str, **fields: object) -> None: ...

    def warning(self, event: str, **fields: object) -> None: ...

    def info(self, event: str, **fields: object) -> None: ...


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

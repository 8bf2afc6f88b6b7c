"""Blob files: one key space's blocks as files, each written atomically and read checked.

Layout under the key space's directory (<k0>: the key's first byte in hex, so no
directory holds more than 1/256 of the blocks; local.py places the directory)::

    <directory>/<k0>/<key hex>          a blob (see blob.py; sealed when the key space
                                        has a storage secret, seal.py)
    <directory>/<k0>/.tmp-<pid>-<random>  a blob being written by process <pid>

A block is written to a temp file in its final directory, flushed with
``fdatasync``, and renamed over its final name with ``os.replace``, which is atomic:
a reader sees no file or a whole one, and a writer killed at any point leaves at
most a temp file, which every scan ignores and the scan of another process removes
once ``<pid>`` is dead (the directory is assumed to be shared by processes of one
machine). Two processes writing the same key both succeed; the later rename wins and
either blob is whole. A file is never changed once visible, so a reader that opened
it reads it whole even if it is replaced or evicted meanwhile.

Durability: the file is flushed before the rename, so a block that is visible after
a machine crash is whole; the directory is not flushed after the rename (one more
flush per block), so a crash may forget recent blocks, which costs only misses.
With ``fsync=False`` nothing is flushed: a crash may then leave a visible but torn
file, which the checksum turns into a miss, so this is safe for a cache and runs at
the speed of a plain write; the flush costs most of the write time on a disk
(measured here: a plain write with an fsync per file ran at 0.4x of one without).

Faults: a block that cannot be written (a full disk or tmpfs, a quota, an I/O error,
reported by the write, the flush, the close or the rename) leaves nothing visible:
its temp file is removed, and the error is returned, not raised (local.py reports it).
A read that raises an ``OSError`` (not a missing file) is returned as well; the file
stays, since the error may pass. Recency stamps (the mtime every scan orders by) are
best effort: a blob whose mtime cannot be set (another user's, a read-only mount)
keeps its age. Blobs are created ``0600``.

Reads with a storage secret (``seal``) take the same paths: a read into the caller's
buffer reads the payload there and then checks its tag, so on a miss the buffer holds the
refused bytes. The store lane's caller never uses such a buffer (the block is reported
missing and recomputed; ``get_into``'s contract), so no unverified byte becomes KV, and a
second buffer would cost every hit a copy.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from typing import Final, NamedTuple

from ringfence.cache.ids import BlockHash
from ringfence.cache.storage.blob import (
    END_BYTES,
    Buffer,
    CorruptBlock,
    blob_size,
    check_fits,
    read_trailer,
    trailer,
    verify,
)
from ringfence.cache.storage.blob_index import TMP_PREFIX
from ringfence.cache.storage.private_dir import DIR_MODE, FILE_MODE
from ringfence.cache.storage.seal import Seal

_O_CREATE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
_O_READ: Final = os.O_RDONLY | os.O_CLOEXEC


class Stored(NamedTuple):
    size: int  # bytes of the blob stored under the key (failed: the bytes it needed)
    written: bool  # False: it was already stored and only its recency was refreshed, or failed
    failed: OSError | None = None  # why it could not be written (nothing of it is visible)


class Loaded(NamedTuple):
    hit: bool  # a whole, valid blob was read
    payload: bytes | None  # what was read, when read into no buffer of the caller's
    size: int  # bytes of the blob, if there was one
    error: CorruptBlock | None  # why a blob that exists was refused
    io_error: OSError | None = None  # why a blob could not be read (not a missing file)


class BlobFiles:
    """The blob files of the key space ``directory``, written by ``fingerprint`` (and
    ``seal``): where a key's file lies, its atomic write and its checked read.

    Holds its settings only and changes none of them, so any thread may call it (the
    backend's pool threads do, several at once); it keeps no index: that is the backend's.
    """

    def __init__(
        self, directory: str, *, fingerprint: bytes, seal: Seal | None, fsync: bool
    ) -> None:
        self.directory = directory
        self.fingerprint = fingerprint
        self.seal = seal  # the storage secret's MAC: blobs are keyed and must verify
        self.fsync = fsync

    def path_for(self, key: BlockHash) -> str:
        """The file a key is stored in under this key space (whether or not it exists)."""
        name = key.hex()
        return os.path.join(self.directory, name[:2], name)

    def store(self, item: tuple[BlockHash, memoryview, int]) -> Stored:
        """Write one block with mtime ``stamp``, unless it is already stored; an ``OSError``
        is returned in ``failed``, with nothing of the block visible."""
        key, view, stamp = item
        path = self.path_for(key)
        size = blob_size(len(view), self.seal)
        try:
            try:
                stored = os.stat(path).st_size
                _touch(path, stamp)  # the same bytes are stored (content key): refresh recency
                return Stored(stored, written=False)
            except FileNotFoundError:
                pass
            self._write_new(key, view, stamp, path)
        except OSError as error:
            return Stored(size, written=False, failed=error)
        return Stored(size, written=True)

    def load(self, item: tuple[BlockHash, memoryview | None, int]) -> Loaded:
        """Read and check one block, and set its mtime to ``stamp`` if it is whole.

        Reads the payload into ``dest`` if given, else into a new ``bytes``.
        """
        key, dest, stamp = item
        try:
            fd = os.open(self.path_for(key), _O_READ)
        except FileNotFoundError:
            return Loaded(False, None, 0, None)
        except OSError as error:
            return Loaded(False, None, 0, None, error)
        try:
            size = os.fstat(fd).st_size
            try:
                end = os.pread(fd, min(size, END_BYTES), max(0, size - END_BYTES))
                tail = read_trailer(self.fingerprint, key, end, size, self.seal)  # bounds the read
                payload = None
                if dest is None:
                    payload = os.pread(fd, tail.length, 0)
                    verify(key, tail, payload, self.seal)
                else:
                    check_fits(key, tail.length, dest)
                    got = dest[: os.preadv(fd, [dest], 0)]  # a read cut short fails
                    verify(key, tail, got, self.seal)
            except CorruptBlock as error:
                return Loaded(False, None, size, error)
            except OSError as error:
                return Loaded(False, None, 0, None, error)
            _touch(fd, stamp)
        finally:
            os.close(fd)
        return Loaded(True, payload, size, None)

    def unlink(self, key: BlockHash) -> bool:
        """Remove a key's file; False if there was none."""
        try:
            os.unlink(self.path_for(key))
        except FileNotFoundError:
            return False
        return True

    def _write_new(self, key: BlockHash, view: memoryview, stamp: int, path: str) -> None:
        """Write a temp file, flush it and rename it to ``path``; on any error remove it."""
        shard = os.path.dirname(path)
        tmp = os.path.join(shard, f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        tail = trailer(self.fingerprint, key, view, self.seal)
        try:
            fd = os.open(tmp, _O_CREATE, FILE_MODE)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):  # another process made it meanwhile
                os.mkdir(shard, DIR_MODE)
            fd = os.open(tmp, _O_CREATE, FILE_MODE)
        try:
            try:
                self._write_blob(fd, view, tail)
                os.utime(fd, ns=(stamp, stamp))
                if self.fsync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)  # may report a write error of its own (NFS): that fails it too
            os.replace(tmp, path)  # the point where the block becomes visible, whole
        except BaseException:
            with contextlib.suppress(OSError):  # the first error is the one to report
                os.unlink(tmp)
            raise

    def _write_blob(self, fd: int, view: memoryview, tail: bytes) -> None:
        """Write payload and trailer to the temp file (tests override it to stop half-way)."""
        total = len(view) + len(tail)
        done = os.writev(fd, (view, tail))
        while done < total:  # a short write (disk nearly full): write the rest, or fail
            rest: list[Buffer] = (
                [view[done:], tail] if done < len(view) else [tail[done - len(view) :]]
            )
            more = os.writev(fd, rest)
            if more == 0:  # no progress and no error: never loop on it
                raise OSError(errno.ENOSPC, f"write of {total} bytes stopped at {done}")
            done += more


def _touch(target: str | int, stamp: int) -> None:
    """Set a blob's mtime to ``stamp``, the recency every process's scan orders by."""
    # Another user's file in a shared directory, or a read-only mount: it keeps its age.
    with contextlib.suppress(OSError):
        os.utime(target, ns=(stamp, stamp))

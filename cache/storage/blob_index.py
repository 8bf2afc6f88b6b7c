"""The ``local`` backend's indexes of the blobs under its fingerprint's directory: its own key
space's (which keys it holds, how many bytes, which is the least recently used) and the other
key spaces' beside it (what its bound evicts besides its own).

Rebuilt from the directory by a scan (the blobs ordered by mtime, the recency stamp every
process sharing the directory writes), which also removes the temp files of writers that
died; kept up to date by the backend's own puts, gets and deletes. They may be stale where
other processes write the same directory: the backend rescans, and a file's presence, not an
index, answers what is stored.

Owned by one backend; not thread-safe.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict, deque
from typing import Final, NamedTuple

from ringfence.cache.ids import BlockHash
from ringfence.cache.storage.blob import KEY_BYTES
from ringfence.cache.storage.seal import NAMESPACE_PREFIX

TMP_PREFIX: Final = ".tmp-"  # a blob being written: .tmp-<pid>-<random>
_HEX: Final = frozenset("0123456789abcdef")


class Oldest(NamedTuple):
    """The least recently used blob of an index."""

    stamp: int  # its recency stamp (mtime, ns)
    size: int  # its bytes
    key: BlockHash | None  # its key (own key space), or None (another's: see ``path``)
    path: str = ""  # another key space's blob: its file


class BlobIndex:
    """Key -> (blob bytes, recency stamp), least recently used first, and their bytes."""

    def __init__(self, blobs: OrderedDict[BlockHash, tuple[int, int]] | None = None) -> None:
        self._blobs: OrderedDict[BlockHash, tuple[int, int]] = (
            blobs if blobs is not None else OrderedDict()
        )
        self.num_bytes = sum(size for size, _ in self._blobs.values())

    @classmethod
    def scan(cls, directory: str) -> BlobIndex:
        """The blobs of a key space's directory (its two-hex-digit shards), oldest mtime
        first; temp files of dead processes there are removed on the way."""
        found = _scan_shards(directory)
        return cls(
            OrderedDict(
                (BlockHash(bytes.fromhex(name)), (size, mtime)) for mtime, name, size in found
            )
        )

    def __len__(self) -> int:
        return len(self._blobs)

    def remember(self, key: BlockHash, size: int, stamp: int) -> None:
        """``key`` is stored with ``size`` bytes, and is now the most recently used."""
        self.num_bytes += size - self._blobs.get(key, (0, 0))[0]
        self._blobs[key] = (size, stamp)
        self._blobs.move_to_end(key)

    def forget(self, key: BlockHash) -> None:
        self.num_bytes -= self._blobs.pop(key, (0, 0))[0]

    def oldest(self) -> Oldest | None:
        """The least recently used blob (None when empty)."""
        for key, (size, stamp) in self._blobs.items():
            return Oldest(stamp=stamp, size=size, key=key)
        return None


class ForeignBlobs:
    """The blobs of the other key spaces of one fingerprint's directory (other storage
    secrets' or none's), oldest first, as the last scan saw them.

    No backend reads them; each backend's bound counts them and evicts them by the one rule
    it applies to its own (least recently used first), so the key space of a secret that no
    instance holds any more ages out instead of staying forever.
    """

    def __init__(self, blobs: list[tuple[int, str, int]] | None = None) -> None:
        self._blobs = deque(blobs or ())  # (mtime ns, path, bytes), oldest first
        self.num_bytes = sum(size for _, _, size in self._blobs)

    @classmethod
    def scan(cls, fingerprint_dir: str, own: str) -> ForeignBlobs:
        """The blobs of every key space under ``fingerprint_dir`` but ``own`` (a directory):
        the plain one (the shards right under it) and each ``s<secret id>``."""
        spaces = [fingerprint_dir]
        with contextlib.suppress(FileNotFoundError), os.scandir(fingerprint_dir) as entries:
            spaces += [e.path for e in entries if _is_namespace_name(e.name) and e.is_dir()]
        found: list[tuple[int, str, int]] = []
        for space in spaces:
            if os.path.abspath(space) != os.path.abspath(own):
                found += [
                    (mtime, os.path.join(space, name[:2], name), size)
                    for mtime, name, size in _scan_shards(space)
                ]
        found.sort()
        return cls(found)

    def __len__(self) -> int:
        return len(self._blobs)

    def oldest(self) -> Oldest | None:
        if not self._blobs:
            return None
        mtime, path, size = self._blobs[0]
        return Oldest(stamp=mtime, size=size, key=None, path=path)

    def evict_oldest(self) -> bool:
        """Remove the oldest blob's file, unless it was used since the scan (its mtime moved:
        it is then left, and learned again by the next scan); True if a file was removed."""
        mtime, path, size = self._blobs.popleft()
        self.num_bytes -= size
        try:
            if os.stat(path).st_mtime_ns != mtime:
                return False
            os.unlink(path)
        except FileNotFoundError:  # its own key space's holder removed it meanwhile
            return False
        return True


def _scan_shards(directory: str) -> list[tuple[int, str, int]]:
    """(mtime ns, key hex, bytes) of each blob in a key space's shards, oldest first; temp
    files of dead writers are removed on the way. A missing directory holds none."""
    found: list[tuple[int, str, int]] = []
    try:
        with os.scandir(directory) as shards:
            shard_paths = [e.path for e in shards if len(e.name) == 2 and e.is_dir()]
    except FileNotFoundError:
        return found
    for shard in shard_paths:
        with contextlib.suppress(FileNotFoundError), os.scandir(shard) as entries:
            for entry in entries:
                if entry.name.startswith(TMP_PREFIX):
                    _remove_if_orphaned(entry.path, entry.name)
                elif _is_key_name(entry.name):
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat()
                        found.append((st.st_mtime_ns, entry.name, st.st_size))
    found.sort()
    return found


def _is_key_name(name: str) -> bool:
    """Whether a file name is a key in hex (any other file in the directory is left alone)."""
    return len(name) == 2 * KEY_BYTES and all(c in _HEX for c in name)


def _is_namespace_name(name: str) -> bool:
    """Whether a directory name is a sealed key space's: ``s`` and a secret's identifier."""
    ident = name[len(NAMESPACE_PREFIX) :]
    return name.startswith(NAMESPACE_PREFIX) and len(ident) == 2 * KEY_BYTES and set(ident) <= _HEX


def _remove_if_orphaned(path: str, name: str) -> None:
    """Remove a temp file whose writer process no longer exists."""
    pid_text = name[len(TMP_PREFIX) :].partition("-")[0]
    if not pid_text.isdigit() or int(pid_text) == os.getpid():
        return
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    except PermissionError:
        pass  # alive, under another user

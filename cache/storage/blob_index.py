"""The ``local`` backend's index of the blobs in its directory: which keys it holds, how
many bytes, and which is the least recently used.

Rebuilt from the directory by :meth:`BlobIndex.scan` (the blobs ordered by mtime, the
recency stamp every process sharing the directory writes), which also removes the temp
files of writers that died; kept up to date by the backend's own puts, gets and deletes.
It may be stale where other processes write the same directory: the backend rescans, and a
file's presence, not the index, answers what is stored.

Owned by one backend; not thread-safe.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from typing import Final

from ringfence.cache.ids import BlockHash
from ringfence.cache.storage.blob import KEY_BYTES

TMP_PREFIX: Final = ".tmp-"  # a blob being written: .tmp-<pid>-<random>
_HEX: Final = frozenset("0123456789abcdef")


class BlobIndex:
    """Key -> blob bytes, least recently used first, and their sum."""

    def __init__(self, blobs: OrderedDict[BlockHash, int] | None = None) -> None:
        self._sizes: OrderedDict[BlockHash, int] = blobs if blobs is not None else OrderedDict()
        self.num_bytes = sum(self._sizes.values())

    @classmethod
    def scan(cls, directory: str) -> BlobIndex:
        """The blobs of a fingerprint's directory (its two-hex-digit shards), oldest mtime
        first; temp files of dead processes there are removed on the way."""
        found: list[tuple[int, str, int]] = []  # (mtime ns, key hex, size)
        with os.scandir(directory) as shards:
            shard_paths = [e.path for e in shards if len(e.name) == 2 and e.is_dir()]
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
        return cls(OrderedDict((BlockHash(bytes.fromhex(name)), size) for _, name, size in found))

    def __len__(self) -> int:
        return len(self._sizes)

    def remember(self, key: BlockHash, size: int) -> None:
        """``key`` is stored with ``size`` bytes, and is now the most recently used."""
        self.num_bytes += size - self._sizes.get(key, 0)
        self._sizes[key] = size
        self._sizes.move_to_end(key)

    def forget(self, key: BlockHash) -> None:
        self.num_bytes -= self._sizes.pop(key, 0)

    def oldest(self) -> tuple[BlockHash, int] | None:
        """The least recently used key and its bytes (None when empty)."""
        return next(iter(self._sizes.items()), None)


def _is_key_name(name: str) -> bool:
    """Whether a file name is a key in hex (any other file in the directory is left alone)."""
    return len(name) == 2 * KEY_BYTES and all(c in _HEX for c in name)


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

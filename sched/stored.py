"""Storage presence as the scheduler sees it: the keys this instance has sent to storage
(counted present at once: the store lane is one FIFO, so a prefetch issued after a
write-back finds the write done), then the backend for keys stored by another instance
or an earlier run. Owned by the block manager, which adds a write-back's keys when it
issues it and takes them out again when it fails (``sched/blocks.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ringfence.cache.ids import BlockHash
from ringfence.cache.prefix_index import StoragePresence


class StoredSet:
    """Storage presence as the index sees it: this instance's writes, then the backend."""

    def __init__(self, backend: StoragePresence | None) -> None:
        self.backend = backend
        self.keys: set[BlockHash] = set()

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        start = 0
        while start < len(keys) and keys[start] in self.keys:
            start += 1
        if start == len(keys) or self.backend is None:
            return start
        # Stored by another instance (or an earlier run): ask the backend for the rest.
        rest = self.backend.longest_prefix(keys[start:])
        found = start + rest
        # Only what follows in our own set can extend the backend's answer further.
        while found < len(keys) and keys[found] in self.keys:
            found += 1
        return found

    def has(self, key: BlockHash) -> bool:
        return key in self.keys or self.longest_prefix([key]) == 1

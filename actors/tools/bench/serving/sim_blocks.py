"""The simulated instance's device blocks (``sim_engine.py``): a pool with a prefix cache
keyed by block hash, whose free cached blocks are evicted least recently used first.
Pure; owned by one engine."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from ringfence.cache.ids import BlockHash


class BlockPool:
    """The device blocks: those held by running requests, those free but still holding a
    cached prefix block (findable by key, evicted least recently used first), and empty ones.

    A block is named by its key once cached; a request's other blocks (its prompt's partial
    tail, its output, a block another request cached first) are only counted. The free
    cached blocks are an ``OrderedDict`` in eviction order: a finished request's blocks go
    to its end tail block first (as vLLM's free queue: a prefix's later blocks are evicted
    before its earlier ones, which more prompts share). Owned by one :class:`SimEngine`."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._refs: dict[BlockHash, int] = {}  # every cached block: requests holding it
        self._free: OrderedDict[BlockHash, None] = OrderedDict()  # cached, held by none
        self._empty = num_blocks  # neither held nor cached

    @property
    def num_free(self) -> int:
        """Blocks a request may take: empty ones and free cached ones (evicted for it)."""
        return self._empty + len(self._free)

    def cached_prefix(self, keys: Sequence[BlockHash]) -> int:
        """How many of ``keys``, from the first, are cached (held or free). Mutates nothing."""
        for n, key in enumerate(keys):
            if key not in self._refs:
                return n
        return len(keys)

    def free_among(self, keys: Sequence[BlockHash]) -> int:
        """How many of ``keys`` (cached ones) are free: holding them takes them off the free."""
        return sum(1 for key in keys if self._refs[key] == 0)

    def hold(self, keys: Sequence[BlockHash]) -> None:
        """One more holder of each of ``keys`` (cached blocks)."""
        for key in keys:
            if self._refs[key] == 0:
                del self._free[key]
            self._refs[key] += 1

    def allocate(self, count: int) -> list[BlockHash]:
        """Take ``count`` blocks: empty ones first, then the least recently used free cached
        ones, whose keys are returned (evicted: no longer findable). AssertionError if fewer
        than ``count`` are free (the caller checks :attr:`num_free` first)."""
        assert count <= self.num_free, f"{count} blocks asked, {self.num_free} free"
        from_empty = min(count, self._empty)
        self._empty -= from_empty
        evicted = []
        for _ in range(count - from_empty):
            key, _ = self._free.popitem(last=False)
            del self._refs[key]
            evicted.append(key)
        return evicted

    def cache(self, key: BlockHash) -> bool:
        """Name one of the caller's uncached held blocks ``key`` (its prefill computed it):
        True; False when ``key`` is cached already (another request computed it first), and
        the block stays unnamed."""
        if key in self._refs:
            return False
        self._refs[key] = 1
        return True

    def release(self, keys: Sequence[BlockHash], unnamed: int) -> None:
        """A request let go of its cached blocks ``keys`` (in prompt order) and ``unnamed``
        others: the cached ones no one holds become free, tail first; the others empty."""
        for key in reversed(keys):
            self._refs[key] -= 1
            if self._refs[key] == 0:
                self._free[key] = None
        self._empty += unnamed

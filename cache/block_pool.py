"""A pool of KV blocks: reference counts, an LRU free queue and lazily evicted cached keys."""

from __future__ import annotations

from array import array
from collections import Counter
from collections.abc import Callable, Iterable
from typing import NamedTuple, cast

from ringfence.cache.ids import BlockHash, BlockId
from ringfence.shm.errors import OutOfBlocks

_KEY_SIZE = 16  # bytes in a BlockHash


class Allocation(NamedTuple):
    """What one allocation handed out and which cached keys it evicted to do so."""

    block_ids: tuple[BlockId, ...]  # the blocks, each with ref count 1, in LRU order
    evicted: tuple[tuple[BlockId, BlockHash], ...]  # (block, key it held), in block_ids order


class BlockPool:
    """The blocks of one tier (the device pool and the host pool are two instances).

    Each block is in use (ref count > 0) or free (ref count 0, in the free queue).
    A block may also hold a key (it is *cached*): ``find(key)`` returns it whether it
    is in use or free. A free cached block keeps its key until an allocation reuses
    it (lazy eviction); that allocation reports the (block, key) pair so the owner
    can demote the contents to the next tier first.

    LRU order: the free queue's head is the least recently freed block; ``allocate``
    takes from the head and ``free`` appends to the tail, so blocks are reused in the
    order they were freed and recently used cached blocks stay findable longest.

    Data structure: an intrusive doubly linked list over flat ``array('q')`` links
    (``_prev``/``_next``, indexed by block id, with one extra sentinel node closing
    the ring), plus an ``array('q')`` of ref counts, a list of keys and one dict
    key -> block. The links give O(1) removal from the middle of the queue when a
    free cached block is taken again (the "touch"), which a deque cannot; flat
    arrays avoid one Python object per block (an OrderedDict or node objects would
    cost over 100 bytes a block); a cached block costs about 160 bytes, its key and
    its dict entry included. Every operation is O(blocks touched).

    Not thread-safe: one owner (the engine) calls it. Only ``allocate``,
    ``try_allocate``, ``free``, ``take``, ``set_key`` and ``drop_key`` mutate; each
    either completes or raises without changing anything.

    ``on_key(key, cached)``, when given, hears of every key the pool gains (True) or loses
    (False), in order: what KV events report (``cache/kv_events.py``).
    """

    __slots__ = (
        "_index",
        "_keys",
        "_next",
        "_num_free",
        "_prev",
        "_ref",
        "_sentinel",
        "name",
        "on_key",
    )

    def __init__(
        self,
        num_blocks: int,
        *,
        name: str,
        on_key: Callable[[BlockHash, bool], None] | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.name = name  # the tier, e.g. "device" or "host"; named in errors
        self._sentinel = num_blocks  # the list node past the last block: ring start and end
        # Free queue links, starting as the ring sentinel, 0, 1, ..., num_blocks - 1;
        # the links of blocks in use are stale and never read.
        self._next = array("q", range(1, num_blocks + 1))  # next[b]: the block after b
        self._next.append(0)
        self._prev = array("q", [num_blocks])  # prev[b]: the block before b
        self._prev.extend(range(num_blocks))
        self._ref = array("q", bytes(8 * num_blocks))  # ref count per block; 0 means free
        self._keys: list[BlockHash | None] = [None] * num_blocks  # the key each block holds
        self._index: dict[BlockHash, BlockId] = {}  # key -> the block holding it (inverse)
        self._num_free = num_blocks  # blocks with ref count 0
        self.on_key = on_key

    @property
    def num_blocks(self) -> int:
        return self._sentinel

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self._sentinel - self._num_free

    @property
    def num_cached(self) -> int:
        """Blocks holding a key, in use or free."""
        return len(self._index)

    def ref_count(self, block_id: BlockId) -> int:
        return self._ref[self._check(block_id)]

    def key_of(self, block_id: BlockId) -> BlockHash | None:
        return self._keys[self._check(block_id)]

    def find(self, key: BlockHash) -> BlockId | None:
        """The block cached under ``key`` (in use or free), or None. Mutates nothing."""
        return self._index.get(key)

    def allocate(self, num_blocks: int) -> Allocation:
        """Take ``num_blocks`` blocks from the LRU head, each with ref count 1; all or nothing.

        A reused block loses its key; the Allocation lists those (block, key) pairs.
        Raises OutOfBlocks (nothing allocated) when fewer blocks are free.
        """
        if not 0 <= num_blocks <= self._num_free:
            if num_blocks < 0:
                raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
            raise OutOfBlocks(
                f"{self.name} pool: asked for {num_blocks} blocks, {self._num_free} free"
            )
        nxt, ref, keys = self._next, self._ref, self._keys
        # Plain ints from the arrays; BlockId() per block would cost a call each.
        block_ids: list[int] = []
        evicted: list[tuple[int, BlockHash]] = []
        block = nxt[self._sentinel]
        for _ in range(num_blocks):
            block_ids.append(block)
            ref[block] = 1
            key = keys[block]
            if key is not None:
                keys[block] = None
                del self._index[key]
                evicted.append((block, key))
            block = nxt[block]
        # Unlink the whole run at once: `block` is the first block left in the queue.
        nxt[self._sentinel] = block
        self._prev[block] = self._sentinel
        self._num_free -= num_blocks
        if evicted and self.on_key is not None:
            for _, key in evicted:
                self.on_key(key, False)
        return Allocation(
            cast("tuple[BlockId, ...]", tuple(block_ids)),
            cast("tuple[tuple[BlockId, BlockHash], ...]", tuple(evicted)) if evicted else (),
        )

    def try_allocate(self, num_blocks: int) -> Allocation | None:
        """As :meth:`allocate`, but None (nothing allocated) when fewer blocks are free."""
        if num_blocks > self._num_free:
            return None
        return self.allocate(num_blocks)

    def free(self, block_ids: Iterable[BlockId]) -> None:
        """Drop one reference to each block; a block reaching 0 joins the free queue's tail.

        Blocks of one call join in the given order, so the first is evicted first:
        free a sequence's blocks tail-first to keep its shared prefix cached longest.
        A block may appear as often as it has references. Raises ValueError, freeing
        nothing, when a block would drop below 0 (it is already free).
        """
        ids = list(block_ids)
        ref, sentinel = self._ref, self._sentinel
        for block in ids:
            if not 0 <= block < sentinel or ref[block] <= 0:
                self._check(block)
                raise ValueError(f"{self.name} pool: block {block} is already free")
        if len(ids) > 1 and len(set(ids)) != len(ids):
            for block, count in Counter(ids).items():
                if count > ref[block]:
                    raise ValueError(
                        f"{self.name} pool: block {block} freed {count} times "
                        f"with {ref[block]} references"
                    )
        nxt, prev = self._next, self._prev
        for block in ids:
            count = ref[block] - 1
            ref[block] = count
            if count == 0:
                tail = prev[sentinel]
                nxt[tail] = block
                prev[block] = tail
                nxt[block] = sentinel
                prev[sentinel] = block
                self._num_free += 1

    def take(self, block_id: BlockId) -> None:
        """One more reference to a block in use, or to a free cached block (a "touch").

        A free cached block leaves the free queue (O(1)) with ref count 1. Raises
        ValueError for a free block that holds no key: its contents are garbage.
        """
        block = block_id if 0 <= block_id < self._sentinel else self._check(block_id)
        count = self._ref[block]
        if count == 0:
            if self._keys[block] is None:
                raise ValueError(f"{self.name} pool: block {block} is free and holds no key")
            nxt, prev = self._next, self._prev
            before, after = prev[block], nxt[block]
            nxt[before] = after
            prev[after] = before
            self._num_free -= 1
        self._ref[block] = count + 1

    def set_key(self, block_id: BlockId, key: BlockHash) -> BlockId:
        """Cache a full block in use under ``key``; returns the block that holds ``key`` after.

        The first block keyed wins: if another block already holds ``key``, this block
        stays unkeyed and that block's id is returned, so the caller can switch to it
        and free its duplicate. Setting the key a block already holds is a no-op.
        Raises ValueError for a free block, a key that is not 16 bytes, or a block
        that already holds a different key (drop it first).
        """
        block = self._check(block_id)
        if self._ref[block] == 0:
            raise ValueError(f"{self.name} pool: block {block} is free; only used blocks are keyed")
        if len(key) != _KEY_SIZE:
            raise ValueError(f"a block key is {_KEY_SIZE} bytes, got {len(key)}")
        current = self._keys[block]
        if current == key:
            return BlockId(block)
        if current is not None:
            raise ValueError(f"{self.name} pool: block {block} already holds another key")
        holder = self._index.get(key)
        if holder is not None:
            return holder
        self._keys[block] = key
        self._index[key] = BlockId(block)
        if self.on_key is not None:
            self.on_key(key, True)
        return BlockId(block)

    def drop_key(self, block_id: BlockId) -> BlockHash | None:
        """Make a block unfindable (in use or free; a free one keeps its queue place).

        Returns the key it held, or None.
        """
        block = self._check(block_id)
        key = self._keys[block]
        if key is not None:
            self._keys[block] = None
            del self._index[key]
            if self.on_key is not None:
                self.on_key(key, False)
        return key

    def free_order(self) -> list[BlockId]:
        """The free queue, LRU head (next to be allocated) first. O(num_free); for tests."""
        order: list[BlockId] = []
        block = self._next[self._sentinel]
        while block != self._sentinel:
            order.append(BlockId(block))
            block = self._next[block]
        return order

    def __repr__(self) -> str:
        return (
            f"BlockPool(name={self.name!r}, num_blocks={self._sentinel}, "
            f"num_free={self._num_free}, num_cached={len(self._index)})"
        )

    def _check(self, block_id: BlockId) -> int:
        """``block_id`` if it names a block of this pool, else ValueError."""
        if not 0 <= block_id < self._sentinel:
            raise ValueError(f"{self.name} pool: no block {block_id} in 0..{self._sentinel - 1}")
        return block_id

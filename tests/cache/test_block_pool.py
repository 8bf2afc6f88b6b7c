"""The block pool: LRU free queue, reference counts, lazily evicted cached keys."""

from __future__ import annotations

import gc
import tracemalloc

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ringfence.cache.block_pool import Allocation, BlockPool
from ringfence.cache.ids import BlockHash, BlockId
from ringfence.shm.errors import OutOfBlocks, RingfenceError


def make_pool(num_blocks: int = 8, *, name: str = "device") -> BlockPool:
    return BlockPool(num_blocks, name=name)


def key(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(16, "little"))


def ids(*blocks: int) -> list[BlockId]:
    return [BlockId(b) for b in blocks]


def allocation(block_ids: list[int], evicted: list[tuple[int, int]] | None = None) -> Allocation:
    """The Allocation of ``block_ids`` that evicted (block, key(n)) for each (block, n)."""
    pairs = tuple((BlockId(block), key(n)) for block, n in evicted or [])
    return Allocation(tuple(BlockId(b) for b in block_ids), pairs)


def make_cached_free_pool(num_blocks: int, free_tail_first: list[int]) -> BlockPool:
    """A pool whose blocks were all used and keyed key(b), then freed in the given order."""
    pool = make_pool(num_blocks)
    for block in pool.allocate(num_blocks).block_ids:
        pool.set_key(block, key(block))
    pool.free(ids(*free_tail_first))
    return pool


# Unit tests


def test_a_new_pool_has_every_block_free_in_id_order():
    pool = make_pool(4)
    assert (pool.num_blocks, pool.num_free, pool.num_used, pool.num_cached) == (4, 4, 0, 0)
    assert pool.free_order() == [0, 1, 2, 3]
    assert repr(pool) == "BlockPool(name='device', num_blocks=4, num_free=4, num_cached=0)"


def test_allocate_takes_blocks_from_the_lru_head_with_one_reference_each():
    pool = make_pool(5)
    assert pool.allocate(3) == allocation([0, 1, 2])
    assert [pool.ref_count(BlockId(b)) for b in range(5)] == [1, 1, 1, 0, 0]
    assert pool.free_order() == [3, 4]
    assert (pool.num_free, pool.num_used) == (2, 3)


def test_allocating_more_than_is_free_raises_out_of_blocks_and_allocates_nothing():
    pool = make_pool(4, name="host")
    pool.allocate(1)
    with pytest.raises(OutOfBlocks, match="host pool: asked for 4 blocks, 3 free") as caught:
        pool.allocate(4)
    assert isinstance(caught.value, MemoryError)
    assert isinstance(caught.value, RingfenceError)
    assert pool.free_order() == [1, 2, 3]
    assert pool.num_free == 3


def test_try_allocate_returns_none_when_too_few_blocks_are_free_and_allocates_nothing():
    pool = make_pool(2)
    assert pool.try_allocate(3) is None
    assert pool.free_order() == [0, 1]
    assert pool.try_allocate(2) == allocation([0, 1])
    assert pool.try_allocate(1) is None


def test_allocating_zero_blocks_returns_an_empty_allocation_and_negative_raises():
    pool = make_pool(2)
    assert pool.allocate(0) == allocation([])
    with pytest.raises(ValueError, match=">= 0"):
        pool.allocate(-1)


def test_a_pool_needs_at_least_one_block():
    with pytest.raises(ValueError, match="num_blocks"):
        make_pool(0)


def test_freed_blocks_join_the_tail_in_the_order_given():
    pool = make_pool(6)
    pool.allocate(4)
    pool.free(ids(2, 0))
    assert pool.free_order() == [4, 5, 2, 0]
    pool.free(ids(3, 1))
    assert pool.free_order() == [4, 5, 2, 0, 3, 1]
    assert pool.allocate(3).block_ids == (4, 5, 2)


def test_freeing_a_sequence_tail_first_evicts_its_tail_first_and_keeps_its_prefix():
    pool = make_cached_free_pool(3, free_tail_first=[2, 1, 0])
    got = pool.allocate(1)
    assert got == allocation([2], evicted=[(2, 2)])
    assert [pool.find(key(b)) for b in range(3)] == [0, 1, None]


def test_a_block_with_two_references_is_free_only_after_both_are_dropped():
    pool = make_pool(2)
    (block,) = pool.allocate(1).block_ids
    pool.take(block)
    pool.free([block])
    assert (pool.ref_count(block), pool.free_order()) == (1, [1])
    pool.free([block])
    assert (pool.ref_count(block), pool.free_order()) == (0, [1, 0])


def test_freeing_a_free_block_raises_and_frees_nothing():
    pool = make_pool(4)
    pool.allocate(2)
    with pytest.raises(ValueError, match="device pool: block 3 is already free"):
        pool.free(ids(1, 3))
    assert [pool.ref_count(BlockId(b)) for b in range(4)] == [1, 1, 0, 0]
    assert pool.free_order() == [2, 3]


def test_freeing_a_block_more_times_than_it_is_referenced_in_one_call_raises_and_frees_nothing():
    pool = make_pool(4)
    pool.allocate(2)
    pool.take(BlockId(1))
    with pytest.raises(ValueError, match="block 0 freed 2 times with 1 references"):
        pool.free(ids(1, 0, 0))
    assert [pool.ref_count(BlockId(b)) for b in range(4)] == [1, 2, 0, 0]
    pool.free(ids(1, 1, 0))
    assert pool.free_order() == [2, 3, 1, 0]


@pytest.mark.parametrize("block", [-1, 4, 100])
def test_a_block_id_outside_the_pool_raises_everywhere(block):
    pool = make_pool(4)
    pool.allocate(4)
    calls = [
        lambda: pool.ref_count(BlockId(block)),
        lambda: pool.key_of(BlockId(block)),
        lambda: pool.free(ids(block)),
        lambda: pool.take(BlockId(block)),
        lambda: pool.set_key(BlockId(block), key(1)),
        lambda: pool.drop_key(BlockId(block)),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=f"no block {block} in 0..3"):
            call()
    assert [pool.ref_count(BlockId(b)) for b in range(4)] == [1, 1, 1, 1]


def test_a_freed_cached_block_stays_findable_until_an_allocation_reuses_it():
    pool = make_cached_free_pool(4, free_tail_first=[1, 0])
    assert [pool.find(key(b)) for b in range(4)] == [0, 1, 2, 3]
    assert pool.allocate(1) == allocation([1], evicted=[(1, 1)])
    assert [pool.find(key(b)) for b in range(4)] == [0, None, 2, 3]
    assert (pool.key_of(BlockId(1)), pool.num_cached) == (None, 3)


def test_an_allocation_reports_every_key_it_evicts_in_block_order():
    pool = make_pool(5)
    pool.allocate(5)
    pool.set_key(BlockId(0), key(10))
    pool.set_key(BlockId(3), key(13))
    pool.free(ids(3, 1, 0, 4, 2))
    got = pool.allocate(4)
    assert got == allocation([3, 1, 0, 4], evicted=[(3, 13), (0, 10)])
    assert pool.num_cached == 0


def test_taking_a_free_cached_block_removes_it_from_the_middle_of_the_queue():
    pool = make_cached_free_pool(4, free_tail_first=[0, 1, 2, 3])
    pool.take(BlockId(2))
    assert (pool.ref_count(BlockId(2)), pool.free_order()) == (1, [0, 1, 3])
    assert (pool.num_free, pool.num_used) == (3, 1)
    pool.free(ids(2))
    assert pool.free_order() == [0, 1, 3, 2]


def test_taking_the_head_and_the_tail_of_the_queue_keeps_the_rest_in_order():
    pool = make_cached_free_pool(4, free_tail_first=[0, 1, 2, 3])
    pool.take(BlockId(0))
    pool.take(BlockId(3))
    assert pool.free_order() == [1, 2]
    assert pool.allocate(2).block_ids == (1, 2)
    assert pool.free_order() == []
    assert pool.try_allocate(1) is None


def test_taking_a_block_in_use_adds_a_reference_without_a_key():
    pool = make_pool(2)
    pool.allocate(1)
    pool.take(BlockId(0))
    assert pool.ref_count(BlockId(0)) == 2


def test_taking_a_free_block_without_a_key_raises():
    pool = make_pool(2)
    with pytest.raises(ValueError, match="block 1 is free and holds no key"):
        pool.take(BlockId(1))
    assert pool.free_order() == [0, 1]


def test_setting_a_key_another_block_holds_keeps_the_first_and_returns_it():
    pool = make_pool(3)
    pool.allocate(3)
    assert pool.set_key(BlockId(1), key(7)) == 1
    assert pool.set_key(BlockId(2), key(7)) == 1
    assert [pool.key_of(BlockId(b)) for b in range(3)] == [None, key(7), None]
    assert pool.find(key(7)) == 1


def test_setting_the_key_a_block_already_holds_changes_nothing():
    pool = make_pool(2)
    pool.allocate(1)
    assert pool.set_key(BlockId(0), key(7)) == 0
    assert pool.set_key(BlockId(0), key(7)) == 0
    assert (pool.find(key(7)), pool.num_cached) == (0, 1)


def test_setting_a_key_on_a_free_block_or_over_another_key_raises():
    pool = make_pool(2)
    pool.allocate(1)
    pool.set_key(BlockId(0), key(1))
    with pytest.raises(ValueError, match="block 1 is free"):
        pool.set_key(BlockId(1), key(2))
    with pytest.raises(ValueError, match="block 0 already holds another key"):
        pool.set_key(BlockId(0), key(2))
    with pytest.raises(ValueError, match="16 bytes"):
        pool.set_key(BlockId(0), BlockHash(b"short"))
    assert ([pool.key_of(BlockId(b)) for b in range(2)], pool.find(key(2))) == (
        [key(1), None],
        None,
    )


def test_dropping_a_key_makes_a_block_unfindable_and_keeps_its_queue_place():
    pool = make_cached_free_pool(3, free_tail_first=[0, 1, 2])
    assert pool.drop_key(BlockId(1)) == key(1)
    assert pool.drop_key(BlockId(1)) is None
    assert (pool.find(key(1)), pool.free_order()) == (None, [0, 1, 2])
    assert pool.allocate(2) == allocation([0, 1], evicted=[(0, 0)])


def test_find_and_the_accessors_mutate_nothing():
    pool = make_cached_free_pool(3, free_tail_first=[2, 0, 1])
    before = (pool.free_order(), pool.num_free, pool.num_cached)
    assert (pool.find(key(0)), pool.find(key(9))) == (0, None)
    assert (pool.key_of(BlockId(2)), pool.ref_count(BlockId(2))) == (key(2), 0)
    assert (pool.free_order(), pool.num_free, pool.num_cached) == before


# Model-based test


class BlockPoolMachine(RuleBasedStateMachine):
    """Drives a BlockPool and a plain model side by side and compares them after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(1)
        self.num_blocks = 1
        self.refs: dict[int, int] = {}  # block -> ref count (absent: 0)
        self.free_queue: list[int] = []  # LRU head first
        self.keys: dict[int, BlockHash] = {}  # block -> key

    @initialize(num_blocks=st.integers(1, 8))
    def start(self, num_blocks: int) -> None:
        self.pool = make_pool(num_blocks)
        self.num_blocks = num_blocks
        self.free_queue = list(range(num_blocks))

    def used(self) -> list[int]:
        return [b for b in range(self.num_blocks) if self.refs.get(b, 0) > 0]

    def allocate_in_model(self, n: int) -> Allocation:
        taken, self.free_queue = self.free_queue[:n], self.free_queue[n:]
        evicted = tuple((BlockId(b), self.keys.pop(b)) for b in taken if b in self.keys)
        for block in taken:
            self.refs[block] = 1
        return Allocation(tuple(BlockId(b) for b in taken), evicted)

    @rule(n=st.integers(0, 9))
    def allocate(self, n: int) -> None:
        if n > len(self.free_queue):
            with pytest.raises(OutOfBlocks):
                self.pool.allocate(n)
        else:
            assert self.pool.allocate(n) == self.allocate_in_model(n)

    @rule(n=st.integers(0, 9))
    def try_allocate(self, n: int) -> None:
        expected = self.allocate_in_model(n) if n <= len(self.free_queue) else None
        assert self.pool.try_allocate(n) == expected

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        references = [b for b in self.used() for _ in range(self.refs[b])]
        chosen = data.draw(
            st.lists(st.sampled_from(references), max_size=4) if references else st.just([])
        )
        counts = {b: chosen.count(b) for b in chosen}
        if any(counts[b] > self.refs[b] for b in counts):
            with pytest.raises(ValueError):
                self.pool.free(ids(*chosen))
            return
        self.pool.free(ids(*chosen))
        for block in chosen:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free_queue.append(block)

    @rule(block=st.integers(0, 7))
    def free_a_free_block_raises(self, block: int) -> None:
        if block < self.num_blocks and self.refs.get(block, 0) == 0:
            with pytest.raises(ValueError):
                self.pool.free(ids(block))

    @rule(block=st.integers(0, 7))
    def take(self, block: int) -> None:
        if block >= self.num_blocks:
            return
        if self.refs.get(block, 0) == 0 and block not in self.keys:
            with pytest.raises(ValueError):
                self.pool.take(BlockId(block))
            return
        self.pool.take(BlockId(block))
        if self.refs.get(block, 0) == 0:
            self.free_queue.remove(block)
        self.refs[block] = self.refs.get(block, 0) + 1

    @rule(block=st.integers(0, 7), n=st.integers(0, 4))
    def set_key(self, block: int, n: int) -> None:
        if block >= self.num_blocks:
            return
        holders = [b for b, k in self.keys.items() if k == key(n)]
        current = self.keys.get(block)
        if self.refs.get(block, 0) == 0 or current not in (None, key(n)):
            with pytest.raises(ValueError):
                self.pool.set_key(BlockId(block), key(n))
        elif holders:
            assert self.pool.set_key(BlockId(block), key(n)) == holders[0]
        else:
            assert self.pool.set_key(BlockId(block), key(n)) == block
            self.keys[block] = key(n)

    @rule(block=st.integers(0, 7))
    def drop_key(self, block: int) -> None:
        if block < self.num_blocks:
            assert self.pool.drop_key(BlockId(block)) == self.keys.pop(block, None)

    @invariant()
    def counts_are_conserved(self) -> None:
        assert self.pool.num_free + self.pool.num_used == self.num_blocks
        assert self.pool.num_free == len(self.free_queue)
        assert self.pool.num_cached == len(self.keys)

    @invariant()
    def the_free_queue_matches_the_model_exactly(self) -> None:
        assert self.pool.free_order() == self.free_queue

    @invariant()
    def no_block_is_both_free_and_referenced(self) -> None:
        counts = [self.pool.ref_count(BlockId(b)) for b in range(self.num_blocks)]
        assert counts == [self.refs.get(b, 0) for b in range(self.num_blocks)]
        assert all(c >= 0 for c in counts)
        assert all(counts[b] == 0 for b in self.pool.free_order())

    @invariant()
    def find_agrees_with_the_model(self) -> None:
        holders = {k: b for b, k in self.keys.items()}
        assert [self.pool.find(key(n)) for n in range(5)] == [holders.get(key(n)) for n in range(5)]
        assert [self.pool.key_of(BlockId(b)) for b in range(self.num_blocks)] == [
            self.keys.get(b) for b in range(self.num_blocks)
        ]


BlockPoolMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None
)
test_the_pool_behaves_like_its_model = BlockPoolMachine.TestCase


# Memory


def bytes_per_cached_block(num_blocks: int) -> float:
    """Traced bytes per block of a pool whose blocks all hold a key and are free (keys included)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        pool = make_pool(num_blocks)
        allocation = pool.allocate(num_blocks)
        for block in allocation.block_ids:
            pool.set_key(block, key(block))
        pool.free(reversed(allocation.block_ids))
        del allocation
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert (pool.num_free, pool.num_cached) == (num_blocks, num_blocks)
    return used / num_blocks


@pytest.mark.slow
def test_a_million_cached_blocks_cost_under_300_bytes_each():
    per_block = bytes_per_cached_block(1_000_000)
    print(f"1,000,000 cached blocks: {per_block:.1f} bytes each")
    assert per_block < 300


def test_a_hundred_thousand_cached_blocks_cost_under_300_bytes_each():
    per_block = bytes_per_cached_block(100_000)
    print(f"100,000 cached blocks: {per_block:.1f} bytes each")
    assert per_block < 300

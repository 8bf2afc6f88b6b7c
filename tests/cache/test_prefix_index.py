"""The prefix index: longest cached prefix across device, host and storage, fastest tier first."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from ringfence.cache.block_hash import Fingerprint, block_keys
from ringfence.cache.block_pool import BlockPool
from ringfence.cache.ids import BlockHash, BlockId
from ringfence.cache.prefix_index import NO_MATCH, PrefixIndex, PrefixMatch

NAMESPACE = Fingerprint(
    model_id="tiny@1",
    dtype="float32",
    block_size=4,
    kv_layout="block-major-v1",
    tp_size=1,
    tp_rank=0,
).digest()
KEYS = block_keys(list(range(100, 132)), 4, namespace=NAMESPACE)  # 8 chained keys


class Storage:
    """A storage tier holding a set of keys (the index asks only ``longest_prefix``)."""

    def __init__(self, keys: Sequence[BlockHash] = ()) -> None:
        self.keys = set(keys)
        self.asked: list[list[BlockHash]] = []

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        self.asked.append(list(keys))
        count = 0
        while count < len(keys) and keys[count] in self.keys:
            count += 1
        return count


def cache_in(pool: BlockPool, *positions: int, free: bool = True) -> list[BlockId]:
    """Cache KEYS[p] for each position in a fresh block of ``pool``, then free it (findable)."""
    blocks = list(pool.allocate(len(positions)).block_ids)
    for block, p in zip(blocks, positions, strict=True):
        pool.set_key(block, KEYS[p])
    if free:
        pool.free(blocks)
    return blocks


def make_index(storage: Storage | None = None) -> tuple[PrefixIndex, BlockPool, BlockPool]:
    device, host = BlockPool(8, name="device"), BlockPool(8, name="host")
    return PrefixIndex(device, host, storage), device, host


def test_a_prefix_held_on_the_device_is_matched_block_by_block():
    index, device, _ = make_index()
    blocks = cache_in(device, 0, 1, 2)
    match = index.match(KEYS)
    assert match == PrefixMatch(tuple(KEYS[:3]), ("device",) * 3, tuple(blocks))


def test_each_block_is_reported_in_the_fastest_tier_that_holds_it():
    index, device, host = make_index()
    (d0, d2) = cache_in(device, 0, 2)
    cache_in(host, 0, 1)  # host block 0 holds KEYS[0] too: the device copy is the one reported
    match = index.match(KEYS)
    assert match.where == ("device", "host", "device")
    assert match.block_ids == (d0, host.find(KEYS[1]), d2)
    assert (match.count("device"), match.count("host"), match.count("storage")) == (2, 1, 0)


def test_without_storage_the_first_block_no_pool_holds_ends_the_prefix():
    index, device, _ = make_index()
    cache_in(device, 0, 1, 3)
    assert index.match(KEYS).keys == tuple(KEYS[:2])
    assert index.match(KEYS[2:]) == NO_MATCH


def test_storage_fills_the_gaps_the_pools_leave_and_is_asked_once_for_them_only():
    storage = Storage([KEYS[1], KEYS[3], KEYS[4]])
    index, device, host = make_index(storage)
    cache_in(device, 0, 2)
    cache_in(host, 5)
    match = index.match(KEYS)
    assert match.where == ("device", "storage", "device", "storage", "storage", "host")
    assert match.block_ids[1] is None
    assert storage.asked == [[KEYS[1], KEYS[3], KEYS[4], KEYS[6], KEYS[7]]]


def test_a_block_no_tier_holds_ends_the_prefix_even_if_later_blocks_are_cached():
    storage = Storage([KEYS[1]])
    index, device, _ = make_index(storage)
    cache_in(device, 0, 3)
    assert index.match(KEYS).where == ("device", "storage")


def test_matching_mutates_nothing():
    index, device, host = make_index(Storage([KEYS[2]]))
    cache_in(device, 0)
    cache_in(host, 1)
    before = [
        (p.num_free, p.free_order(), [p.ref_count(BlockId(b)) for b in range(8)])
        for p in (device, host)
    ]
    index.match(KEYS)
    after = [
        (p.num_free, p.free_order(), [p.ref_count(BlockId(b)) for b in range(8)])
        for p in (device, host)
    ]
    assert after == before


def test_acquire_takes_a_reference_on_each_pool_block_and_pulls_free_ones_off_the_queue():
    index, device, host = make_index(Storage([KEYS[2]]))
    (d0,) = cache_in(device, 0)
    (h1,) = cache_in(host, 1)
    match = index.match(KEYS)
    index.acquire(match)
    assert (device.ref_count(d0), host.ref_count(h1)) == (1, 1)
    assert d0 not in device.free_order() and h1 not in host.free_order()
    assert device.allocate(7).evicted == ()  # the acquired cached block is not reused


def test_acquiring_a_stale_match_is_refused_and_takes_nothing():
    index, device, host = make_index()
    (d0,) = cache_in(device, 0)
    (h1,) = cache_in(host, 1)
    match = index.match(KEYS)
    host.allocate(8)  # reuses every host block: h1 loses its key
    with pytest.raises(ValueError, match=f"stale prefix match: host block {h1}"):
        index.acquire(match)
    assert device.ref_count(d0) == 0 and d0 in device.free_order()


TIERS = st.sampled_from(["device", "host", "storage", "none", "device+host", "host+storage"])


@given(st.lists(TIERS, min_size=1, max_size=8))
def test_the_match_is_the_longest_prefix_held_anywhere_in_its_fastest_tier(layout):
    storage = Storage([KEYS[p] for p, t in enumerate(layout) if "storage" in t])
    index, device, host = make_index(storage)
    for p, tiers in enumerate(layout):
        for pool in (device, host):
            if pool.name in tiers:
                cache_in(pool, p)
    expected: list[str] = []
    for tiers in layout:
        if tiers == "none":
            break
        expected.append(next(t for t in ("device", "host", "storage") if t in tiers))
    match = index.match(KEYS[: len(layout)])
    assert list(match.where) == expected
    assert match.keys == tuple(KEYS[: len(expected)])


class IndexMachine(RuleBasedStateMachine):
    """Random pool and storage changes; after each, the index agrees with a brute-force scan
    of every block's key, matching changes nothing, and both pools conserve their blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.storage = Storage()
        self.index, self.device, self.host = make_index(self.storage)
        self.held: dict[str, list[BlockId]] = {"device": [], "host": []}  # refs we hold

    def pool(self, name: str) -> BlockPool:
        return self.device if name == "device" else self.host

    @rule(tier=st.sampled_from(["device", "host"]), position=st.integers(0, 7), keep=st.booleans())
    def cache_a_block(self, tier: str, position: int, keep: bool) -> None:
        pool = self.pool(tier)
        allocation = pool.try_allocate(1)
        if allocation is None:
            return
        (block,) = allocation.block_ids
        holder = pool.set_key(block, KEYS[position])
        if keep:
            self.held[tier].append(block)
        else:
            pool.free([block])
        assert holder == block or pool.key_of(block) is None

    @rule(tier=st.sampled_from(["device", "host"]), data=st.data())
    def release_one(self, tier: str, data: st.DataObject) -> None:
        if self.held[tier]:
            block = data.draw(st.sampled_from(self.held[tier]))
            self.held[tier].remove(block)
            self.pool(tier).free([block])

    @rule(position=st.integers(0, 7), present=st.booleans())
    def change_storage(self, position: int, present: bool) -> None:
        (self.storage.keys.add if present else self.storage.keys.discard)(KEYS[position])

    @rule(upto=st.integers(1, 8))
    def acquire_and_release_a_match(self, upto: int) -> None:
        match = self.index.match(KEYS[:upto])
        self.index.acquire(match)
        for tier, block in zip(match.where, match.block_ids, strict=True):
            if block is not None:
                self.pool(tier).free([block])

    def brute_force(self, upto: int) -> list[str]:
        held = {tier: {self.pool(tier).key_of(BlockId(b)) for b in range(8)} for tier in self.held}
        where: list[str] = []
        for key in KEYS[:upto]:
            tier = next(
                (t for t in ("device", "host") if key in held[t]),
                "storage" if key in self.storage.keys else None,
            )
            if tier is None:
                break
            where.append(tier)
        return where

    @invariant()
    def the_index_agrees_with_a_scan_and_matching_changes_nothing(self) -> None:
        pools = (self.device, self.host)
        before = [(p.free_order(), [p.ref_count(BlockId(b)) for b in range(8)]) for p in pools]
        for upto in (1, 4, 8):
            assert list(self.index.match(KEYS[:upto]).where) == self.brute_force(upto)
        after = [(p.free_order(), [p.ref_count(BlockId(b)) for b in range(8)]) for p in pools]
        assert after == before
        for p in pools:
            assert p.num_free + p.num_used == p.num_blocks


IndexMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
test_the_index_follows_random_pool_and_storage_changes = IndexMachine.TestCase

"""KV events (cache/kv_events.py): the journal's events, and on a real scheduler every key
a tier gains or loses told in order, so that a follower of the events holds exactly what
each tier holds."""

from __future__ import annotations

import pytest
from kv_follow import follow
from modelcheck.tables import driven

from ringfence.cache.block_hash import block_key
from ringfence.cache.block_pool import BlockPool
from ringfence.cache.ids import BlockHash, BlockId
from ringfence.cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventJournal,
)

NS = b"\0" * 16  # tables.py's namespace


def key(n: int) -> BlockHash:
    return BlockHash(n.to_bytes(16, "big"))


Link = tuple[BlockHash, BlockHash | None, tuple[int, ...]]  # a block's key, parent, tokens


def chain(count: int, block_size: int = 2) -> list[Link]:
    """(key, parent, tokens) of a chain of ``count`` blocks."""
    out: list[Link] = []
    parent: BlockHash | None = None
    for i in range(count):
        tokens = tuple(range(i * block_size, (i + 1) * block_size))
        k = block_key(parent, tokens, namespace=NS)
        out.append((k, parent, tokens))
        parent = k
    return out


def test_a_chain_stored_on_one_tier_is_one_event_with_its_tokens_in_order():
    journal = KVEventJournal(2, lineage=16)
    blocks = chain(3)
    for k, parent, tokens in blocks:
        journal.note(k, parent, tokens)
    for k, _, _ in blocks:
        journal.stored("device", k)
    journal.stored("host", blocks[0][0])
    assert journal.take() == [
        BlockStored(keys=tuple(k for k, _, _ in blocks), parent=None,
                    token_ids=(0, 1, 2, 3, 4, 5), block_size=2, medium="GPU"),
        BlockStored(keys=(blocks[0][0],), parent=None, token_ids=(0, 1), block_size=2,
                    medium="CPU"),
    ]  # fmt: skip
    assert journal.take() == []


def test_blocks_out_of_chain_order_start_new_events_and_removals_of_a_tier_join():
    journal = KVEventJournal(2, lineage=16)
    blocks = chain(2)
    for k, parent, tokens in blocks:
        journal.note(k, parent, tokens)
    journal.stored("device", blocks[1][0])  # the child first: its own event, its parent named
    journal.stored("device", blocks[0][0])
    journal.removed("device", blocks[1][0])
    journal.removed("device", blocks[0][0])
    journal.removed("host", key(9))
    events = journal.take()
    assert [type(e).__name__ for e in events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "BlockRemoved",
    ]
    assert events[0].parent == blocks[0][0]  # type: ignore[union-attr]
    assert events[2] == BlockRemoved(keys=(blocks[1][0], blocks[0][0]), medium="GPU")
    assert events[3] == BlockRemoved(keys=(key(9),), medium="CPU")


def test_a_clear_is_one_event_and_the_removals_it_causes_are_left_out():
    journal = KVEventJournal(2, lineage=16)
    with journal.clearing("device"):
        journal.removed("device", key(1))
        journal.removed("host", key(2))
    journal.removed("device", key(3))
    with journal.clearing(None):
        journal.removed("host", key(4))
    assert journal.take() == [
        AllBlocksCleared(medium="GPU"),
        BlockRemoved(keys=(key(2),), medium="CPU"),
        BlockRemoved(keys=(key(3),), medium="GPU"),
        AllBlocksCleared(medium=None),
    ]


def test_a_key_whose_lineage_was_dropped_is_stored_alone_without_tokens_and_counted():
    journal = KVEventJournal(2, lineage=2)
    for n in range(3):
        journal.note(key(n), None, (n, n))
    journal.stored("device", key(0))  # its lineage was the least recently used: dropped
    journal.stored("device", key(2))
    assert journal.take()[0] == BlockStored(
        keys=(key(0),), parent=None, token_ids=(), block_size=2, medium="GPU"
    )
    assert journal.degraded == 1
    with pytest.raises(ValueError, match="a block has 2 tokens, got 3"):
        journal.note(key(5), None, (1, 2, 3))


def test_a_pool_tells_every_key_it_gains_and_loses():
    heard: list[tuple[BlockHash, bool]] = []
    pool = BlockPool(2, name="device", on_key=lambda k, cached: heard.append((k, cached)))
    first = pool.allocate(2).block_ids
    pool.set_key(first[0], key(1))
    pool.set_key(first[1], key(2))
    pool.set_key(first[1], key(2))  # already held: nothing new
    pool.drop_key(first[1])
    pool.free(first)
    pool.allocate(1)  # reuses block 0: its key is evicted
    assert heard == [(key(1), True), (key(2), True), (key(2), False), (key(1), False)]


@pytest.mark.parametrize("policy", ["swap", "save", "recompute"])
def test_a_follower_of_a_schedulers_events_holds_what_each_tier_holds(policy):
    """Random requests with shared prefixes on small pools (every tier busy, transfers
    failing now and then, Worker restarts), seeded: at the end, the device and host keys
    the events describe are the pools' keys, and the storage keys are what completed
    write-backs stored."""
    kinds: set[str] = set()
    for seed in range(20):
        journal = KVEventJournal(4, lineage=1000)
        sched, _ = driven(seed, device_blocks=8, host_blocks=8, requests=8,
                          preemption=policy, kv_events=journal)  # fmt: skip
        events = journal.take()
        held = follow(events, 4, NS)
        pools = {"GPU": sched.blocks.device, "CPU": sched.blocks.host}
        for medium, pool in pools.items():
            keys = {pool.key_of(BlockId(b)) for b in range(pool.num_blocks)} - {None}
            assert held[medium] == keys, f"seed {seed}, {medium}"
        assert held["STORAGE"] <= sched.blocks.stored.keys, f"seed {seed}"
        assert journal.degraded == 0
        kinds.update(f"{type(e).__name__} {getattr(e, 'medium', None)}" for e in events)
    expected = {"BlockStored GPU", "BlockRemoved GPU", "BlockStored CPU", "BlockRemoved CPU",
                "BlockStored STORAGE", "AllBlocksCleared GPU"}  # fmt: skip
    assert expected <= kinds, kinds

"""BlockManager's operations for the scheduler's host holds and spoiled copies, with the
exact pools they leave: reference counts, keys and the free queue (LRU head first)."""

from __future__ import annotations

from ringfence.cache.block_pool import BlockPool
from ringfence.cache.ids import BlockHash, BlockId
from ringfence.sched.blocks import BlockManager
from ringfence.sched.config import TierConfig


def key(n: int) -> BlockHash:
    return BlockHash(bytes([n]) * 16)


def manager(device_blocks: int = 4, host_blocks: int = 6) -> BlockManager:
    return BlockManager(
        TierConfig(
            block_size=4,
            device_blocks=device_blocks,
            host_blocks=host_blocks,
            host_cache=True,
            storage=False,
        )
    )


def refs(pool: BlockPool) -> list[int]:
    return [pool.ref_count(BlockId(b)) for b in range(pool.num_blocks)]


def keys(pool: BlockPool) -> list[BlockHash | None]:
    return [pool.key_of(BlockId(b)) for b in range(pool.num_blocks)]


def ids(*blocks: int) -> list[BlockId]:
    return [BlockId(b) for b in blocks]


def cached_on_host(blocks: BlockManager, *pairs: tuple[int, int]) -> None:
    """Leave host blocks free and cached: (block, key number) pairs, freed in that order.
    The host pool must be untouched: blocks are allocated 0, 1, ... in order."""
    host = blocks.allocate_host(len(pairs))
    assert host == ids(*range(len(pairs)))
    assert blocks.hold_on_host(host, [key(k) for _, k in sorted(pairs)]) == host
    blocks.release_host(ids(*(b for b, _ in pairs)))


def test_release_host_drops_one_reference_each_and_frees_in_the_order_given():
    blocks = manager()
    host = blocks.allocate_host(3)
    assert host == ids(0, 1, 2)
    blocks.host.take(BlockId(1))  # a second holder of block 1
    blocks.release_host(ids(2, 1, 0))
    assert refs(blocks.host) == [0, 1, 0, 0, 0, 0]
    assert blocks.host.free_order() == ids(3, 4, 5, 2, 0)
    blocks.release_host([])  # nothing held: a no-op
    assert blocks.host.free_order() == ids(3, 4, 5, 2, 0)
    assert blocks.issuer.take_ops() == []  # freeing issues nothing


def test_released_host_blocks_keep_their_keys_and_stay_findable():
    blocks = manager()
    cached_on_host(blocks, (1, 8), (0, 7))
    assert keys(blocks.host) == [key(7), key(8), None, None, None, None]
    assert refs(blocks.host) == [0] * 6
    assert blocks.host.free_order() == ids(2, 3, 4, 5, 1, 0)
    assert blocks.host.find(key(8)) == 1


def test_hold_on_host_keys_the_blocks_and_holds_an_existing_copy_instead_of_a_duplicate():
    blocks = manager()
    cached_on_host(blocks, (0, 1))  # key 1 is cached, free, in host block 0
    host = blocks.allocate_host(4)
    assert host == ids(1, 2, 3, 4)
    blocks.host.set_key(BlockId(4), key(9))  # key 9 is held, in use, by block 4
    held = blocks.hold_on_host(host[:3], [key(0), key(1), key(9)])
    # Block 2 and 3 were duplicates: handed back, unkeyed, in order; 0 and 4 held instead.
    assert held == ids(1, 0, 4)
    assert refs(blocks.host) == [1, 1, 0, 0, 2, 0]
    assert keys(blocks.host) == [key(1), key(0), None, None, key(9), None]
    assert blocks.host.free_order() == ids(5, 2, 3)
    assert blocks.issuer.take_ops() == []


def test_hold_on_host_of_a_block_that_holds_its_key_already_keeps_it():
    blocks = manager()
    host = blocks.allocate_host(1)
    assert host is not None
    assert blocks.hold_on_host(host, [key(3)]) == host
    assert blocks.hold_on_host(host, [key(3)]) == host
    assert refs(blocks.host) == [1, 0, 0, 0, 0, 0]
    assert keys(blocks.host)[0] == key(3)


def test_release_host_hits_drops_the_references_acquire_took_on_host_hits_only():
    blocks = manager()
    device = blocks.allocate_device(1)
    assert device == ids(0)
    blocks.filled(device, [key(1)])  # write-back: no copy down
    cached_on_host(blocks, (1, 3), (0, 2))
    match = blocks.match([key(1), key(2), key(3), key(4)])
    assert match.where == ("device", "host", "host")
    assert match.block_ids == (0, 0, 1)
    blocks.acquire(match)
    assert refs(blocks.device) == [2, 0, 0, 0]
    assert refs(blocks.host) == [1, 1, 0, 0, 0, 0]
    assert blocks.host.free_order() == ids(2, 3, 4, 5)
    blocks.release_host_hits(match)
    assert refs(blocks.device) == [2, 0, 0, 0]  # the device hit stays the sequence's
    assert refs(blocks.host) == [0] * 6
    assert blocks.host.free_order() == ids(2, 3, 4, 5, 0, 1)  # in match order
    assert keys(blocks.host)[:2] == [key(2), key(3)]
    assert blocks.issuer.take_ops() == []


def test_forget_copies_drops_every_key_of_the_sequence_on_both_tiers_and_nothing_else():
    blocks = manager()
    device = blocks.allocate_device(3)
    assert device == ids(0, 1, 2)
    blocks.filled(device[:2], [key(1), key(2)])  # block 2: the partial last block
    other = blocks.allocate_device(1)
    assert other == ids(3)
    blocks.filled(other, [key(5)])  # another sequence's block
    cached_on_host(blocks, (0, 1), (1, 2), (2, 5))  # host copies, one of another sequence
    blocks.free_device(ids(0))  # free and cached: it must lose its key too
    before = (refs(blocks.device), refs(blocks.host))
    device_order, host_order = blocks.device.free_order(), blocks.host.free_order()
    blocks.forget_copies(device[1:], [key(1), key(2)])
    assert keys(blocks.device) == [None, None, None, key(5)]
    assert keys(blocks.host) == [None, None, key(5), None, None, None]
    assert (refs(blocks.device), refs(blocks.host)) == before
    assert blocks.device.free_order() == device_order
    assert blocks.host.free_order() == host_order
    assert blocks.match([key(1)]).where == ()
    assert blocks.issuer.take_ops() == []

"""The tracker's shortcuts for steps (the last step's reads kept whole and stamped lazily,
the swap lane's writes above the step lane's floor kept apart) give every fence the plain
per-block rule gives, on op streams shaped as the scheduler's and on random ones."""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import pytest

from ringfence.cache.fences import Fence, FenceTracker, Lane, Tier
from ringfence.cache.ids import BlockId, Seq

STEP, SWAP, STORE = Lane.STEP, Lane.SWAP, Lane.STORE
DEVICE_BLOCKS, HOST_BLOCKS = 96, 64
Key = tuple[str, int]  # (tier, block id)


class PlainRule:
    """cache/fences.py's rule block by block, every record stamped at once: the reference."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int) -> None:
        self.sizes = {"device": num_device_blocks, "host": num_host_blocks}
        self.last_write: dict[Lane, dict[Key, int]] = {lane: {} for lane in Lane}
        self.last_access: dict[Lane, dict[Key, int]] = {lane: {} for lane in Lane}
        self.previous: dict[Lane, dict[Lane, int]] = {lane: dict.fromkeys(Lane, 0) for lane in Lane}
        self.issued = dict.fromkeys(Lane, 0)

    def issue(self, lane: Lane, seq: int, **sets: Collection[int]) -> Fence:
        """The fence, or ValueError with nothing recorded."""
        touched = {name: [(name.split("_")[1], b) for b in ids] for name, ids in sets.items()}
        if seq <= self.issued[lane]:
            raise ValueError("op numbers must increase")
        for tier, b in (key for keys in touched.values() for key in keys):
            if not 0 <= b < self.sizes[tier]:
                raise ValueError(f"{tier} block id {b} out of range")
        reads = touched.get("read_device", []) + touched.get("read_host", [])
        writes = touched.get("write_device", []) + touched.get("write_host", [])
        waits = dict(self.previous[lane])
        for other in Lane:
            if other is lane:
                continue
            for key in reads:
                waits[other] = max(waits[other], self.last_write[other].get(key, 0))
            for key in writes:
                waits[other] = max(waits[other], self.last_access[other].get(key, 0))
        self.previous[lane] = waits
        self.issued[lane] = seq
        for key in reads:
            self.last_access[lane][key] = seq
        for key in writes:
            self.last_access[lane][key] = self.last_write[lane][key] = seq
        return Fence(step=Seq(waits[STEP]), swap=Seq(waits[SWAP]), store=Seq(waits[STORE]))


@dataclass
class Both:
    """The tracker and the reference, fed the same ops; every fence compared."""

    rng: random.Random
    tracker: FenceTracker = field(default_factory=lambda: FenceTracker(DEVICE_BLOCKS, HOST_BLOCKS))
    plain: PlainRule = field(default_factory=lambda: PlainRule(DEVICE_BLOCKS, HOST_BLOCKS))
    numbers: dict[Lane, int] = field(default_factory=lambda: dict.fromkeys(Lane, 0))
    fences: int = 0

    def issue(self, lane: Lane, **sets: Collection[int]) -> None:
        seq = self.numbers[lane] + 1
        if lane is STEP and "read_device" in sets and self.rng.random() < 0.3:
            sets["read_device"] = list(sets["read_device"])  # not a frozenset: copied
        try:
            want = self.plain.issue(lane, seq, **sets)
        except ValueError:
            with pytest.raises(ValueError):
                self.tracker.issue(lane, Seq(seq), **as_ids(sets))
            return
        got = self.tracker.issue(lane, Seq(seq), **as_ids(sets))
        assert got == want, f"{lane} op {seq} of {sets}: {got}, the plain rule {want}"
        self.numbers[lane] = seq
        self.fences += 1
        if self.rng.random() < 0.05:  # the records asked for, pending stamps written in
            self.check_records()

    def check_records(self) -> None:
        for tier in Tier:
            for lane in Lane:
                if (tier, lane) in ((Tier.DEVICE, STORE), (Tier.HOST, STEP)):
                    continue
                last_write, last_access = self.tracker.records(tier, lane)
                for b in range(len(last_write)):
                    key = (str(tier), b)
                    assert last_write[b] == self.plain.last_write[lane].get(key, 0)
                    assert last_access[b] == self.plain.last_access[lane].get(key, 0)


def ids(*b: int) -> frozenset[BlockId]:
    return frozenset(BlockId(x) for x in b)


def at(*b: int) -> list[BlockId]:
    return [BlockId(x) for x in b]


def as_ids(sets: dict[str, Collection[int]]) -> dict[str, Collection[BlockId]]:
    return {name: ids for name, ids in sets.items()}  # type: ignore[misc]


def scheduler_shaped(both: Both, num_ops: int) -> None:
    """Sequences whose tables grow; steps read the running ones' tables whole and write
    their last blocks; sequences finish (blocks freed and reused), are swapped out and in,
    their host blocks written back and prefetched; now and then a bad block id."""
    rng = both.rng
    free_device, free_host = list(range(DEVICE_BLOCKS)), list(range(HOST_BLOCKS))
    rng.shuffle(free_device)
    rng.shuffle(free_host)
    running: list[list[int]] = []
    swapped: list[list[int]] = []
    for _ in range(num_ops):
        roll = rng.random()
        if roll < 0.1 and free_device:  # admit
            running.append([free_device.pop()])
        elif roll < 0.55 and running:  # a step over some running sequences
            batch = rng.sample(running, rng.randint(1, len(running)))
            for table in batch:
                if free_device and rng.random() < 0.3:
                    table.append(free_device.pop())
            reads = frozenset(b for table in batch for b in table)
            writes = {table[-1] for table in batch}
            if rng.random() < 0.05:
                reads |= {rng.choice([-1, DEVICE_BLOCKS, DEVICE_BLOCKS + 7])}
            both.issue(STEP, read_device=reads, write_device=writes)
        elif roll < 0.65 and running:  # finish: its blocks free at once (fence at use)
            free_device.extend(running.pop(rng.randrange(len(running))))
        elif roll < 0.75 and running and len(free_host) >= len(running[-1]):  # swap out
            table = running.pop()
            host = [free_host.pop() for _ in table]
            both.issue(SWAP, read_device=table, write_host=host)
            free_device.extend(table)
            swapped.append(host)
        elif roll < 0.85 and swapped and len(free_device) >= len(swapped[0]):  # swap in
            host = swapped.pop(0)
            table = [free_device.pop() for _ in host]
            both.issue(SWAP, read_host=host, write_device=table)
            free_host.extend(host)
            running.append(table)
        elif roll < 0.92 and swapped:  # a write-back of a swapped sequence's blocks
            both.issue(STORE, read_host=rng.choice(swapped))
        elif free_host:  # a prefetch into a free host block
            both.issue(STORE, write_host=[rng.choice(free_host)])


def any_ops(both: Both, num_ops: int) -> None:
    """Ops of every kind on random, overlapping block sets of a small pool."""
    rng = both.rng

    def some(n: int) -> list[int]:
        return rng.sample(range(n), rng.randint(0, min(n, 12)))

    kinds: list[tuple[Lane, Callable[[], dict[str, Collection[int]]]]] = [
        (STEP, lambda: {"read_device": frozenset(some(24)), "write_device": some(24)[:3]}),
        (SWAP, lambda: {"read_host": some(16), "write_device": some(24)}),
        (SWAP, lambda: {"read_device": some(24), "write_host": some(16)}),
        (STORE, lambda: {"read_host": some(16)}),
        (STORE, lambda: {"write_host": some(16)}),
    ]
    for _ in range(num_ops):
        lane, sets = rng.choice(kinds)
        both.issue(lane, **sets())


@pytest.mark.parametrize("seed", range(40))
def test_fences_on_scheduler_shaped_streams_equal_the_plain_rule(seed):
    both = Both(random.Random(seed))
    scheduler_shaped(both, 400)
    both.check_records()
    assert both.fences > 150 and both.numbers[SWAP] > 5 and both.numbers[STEP] > 50


@pytest.mark.parametrize("seed", range(40))
def test_fences_on_random_streams_equal_the_plain_rule(seed):
    both = Both(random.Random(seed))
    any_ops(both, 300)
    both.check_records()
    assert both.fences > 250


def test_a_swap_in_waits_for_the_last_step_still_reading_its_block_before_any_stamp():
    tracker = FenceTracker(8, 8)
    tracker.issue(STEP, Seq(1), read_device=ids(0, 1), write_device=at(1))
    tracker.issue(STEP, Seq(2), read_device=ids(0, 1, 2), write_device=at(2))
    # Block 0 was last read by step 2, which nothing has stamped yet: the kept read set.
    assert tracker.issue(SWAP, Seq(1), read_host=at(0), write_device=at(0)).step == 2


def test_a_step_reading_a_swapped_in_block_waits_once_then_its_floor_covers_it():
    tracker = FenceTracker(8, 8)
    tracker.issue(SWAP, Seq(1), read_host=at(0), write_device=at(5))
    assert tracker.issue(STEP, Seq(1), read_device=ids(4)).swap == 0
    assert tracker.issue(STEP, Seq(2), read_device=ids(4, 5)).swap == 1
    assert tracker.issue(STEP, Seq(3), read_device=ids(4)).swap == 1  # monotone


def test_a_step_reading_a_block_out_of_range_is_refused_though_the_last_read_the_rest():
    tracker = FenceTracker(8, 8)
    tracker.issue(STEP, Seq(1), read_device=ids(0, 1))
    with pytest.raises(ValueError, match=r"device block ids must lie in \[0, 8\): got \[8\]"):
        tracker.issue(STEP, Seq(2), read_device=ids(0, 1, 8))
    # Nothing recorded: the next step may take number 2, and block 1's reader is step 1.
    tracker.issue(STEP, Seq(2), read_device=ids(0))
    assert tracker.issue(SWAP, Seq(1), read_host=at(0), write_device=at(1)).step == 1

"""Fences: the four invariants, readers and lanes, and fenced execution equals issue order."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringfence.cache.fences import NO_WAIT, Access, Fence, FenceTracker, Lane, Tier
from ringfence.cache.ids import BlockId, Seq

STEP, SWAP, STORE = Lane.STEP, Lane.SWAP, Lane.STORE


def make_tracker(num_device_blocks: int = 8, num_host_blocks: int = 8) -> FenceTracker:
    return FenceTracker(num_device_blocks, num_host_blocks)


def blocks(*ids: int) -> tuple[BlockId, ...]:
    return tuple(BlockId(i) for i in ids)


def test_a_step_waits_for_the_swap_in_that_fills_its_block():  # I1
    tracker = make_tracker()
    assert tracker.issue(SWAP, Seq(3), read_host=blocks(2), write_device=blocks(7)) == NO_WAIT
    fence = tracker.issue(STEP, Seq(5), read_device=blocks(6, 7), write_device=blocks(7))
    assert fence == Fence(swap=Seq(3))


def test_a_swap_out_waits_for_the_step_that_wrote_its_block():  # I2
    tracker = make_tracker()
    assert tracker.issue(STEP, Seq(4), read_device=blocks(7), write_device=blocks(7)) == NO_WAIT
    fence = tracker.issue(SWAP, Seq(1), read_device=blocks(7), write_host=blocks(2))
    assert fence == Fence(step=Seq(4))


def test_a_swap_in_waits_for_the_step_that_still_reads_the_reused_block():  # I3
    tracker = make_tracker()
    assert tracker.issue(STEP, Seq(5), read_device=blocks(7)) == NO_WAIT
    # Block 7 is freed and handed to another request at once: no round trip, a fence instead.
    fence = tracker.issue(SWAP, Seq(3), read_host=blocks(1), write_device=blocks(7))
    assert fence == Fence(step=Seq(5))


def test_a_write_back_waits_for_the_swap_out_that_fills_its_host_block():  # I4
    tracker = make_tracker()
    assert tracker.issue(SWAP, Seq(2), read_device=blocks(7), write_host=blocks(4)) == NO_WAIT
    assert tracker.issue(STORE, Seq(1), read_host=blocks(4)) == Fence(swap=Seq(2))


def test_a_swap_out_waits_for_the_write_back_that_still_reads_its_host_block():  # I4
    tracker = make_tracker()
    tracker.issue(SWAP, Seq(1), read_device=blocks(0), write_host=blocks(4))
    assert tracker.issue(STORE, Seq(6), read_host=blocks(4)) == Fence(swap=Seq(1))
    fence = tracker.issue(SWAP, Seq(2), read_device=blocks(3), write_host=blocks(4))
    assert fence == Fence(store=Seq(6))


def test_a_swap_out_over_what_a_swap_in_reads_is_ordered_by_the_swap_fifo_alone():  # I4
    tracker = make_tracker()
    assert tracker.issue(SWAP, Seq(1), read_host=blocks(4), write_device=blocks(0)) == NO_WAIT
    fence = tracker.issue(SWAP, Seq(2), read_device=blocks(5), write_host=blocks(4))
    assert fence == NO_WAIT


def test_prefetch_and_swap_in_of_one_host_block_wait_for_each_other_in_issue_order():  # I4
    tracker = make_tracker()
    fences = [
        tracker.issue(STORE, Seq(1), write_host=blocks(4)),  # prefetch fills host block 4
        tracker.issue(SWAP, Seq(1), read_host=blocks(4), write_device=blocks(0)),  # swap-in
        tracker.issue(STORE, Seq(2), write_host=blocks(4)),  # a prefetch reuses block 4
    ]
    assert fences == [NO_WAIT, Fence(store=Seq(1)), Fence(swap=Seq(1))]


def test_readers_never_wait_for_readers():
    tracker = make_tracker()
    assert tracker.issue(STEP, Seq(1), read_device=blocks(7)) == NO_WAIT
    # A write-through copy of a hot prefix block neither waits for nor stalls the steps.
    assert tracker.issue(SWAP, Seq(1), read_device=blocks(7), write_host=blocks(0)) == NO_WAIT
    assert tracker.issue(STEP, Seq(2), read_device=blocks(7)) == NO_WAIT


def test_a_step_that_writes_a_block_is_a_writer_that_waits_and_is_waited_for():
    tracker = make_tracker()
    assert tracker.issue(STEP, Seq(1), read_device=blocks(7), write_device=blocks(7)) == NO_WAIT
    fence = tracker.issue(SWAP, Seq(1), read_device=blocks(7), write_host=blocks(0))
    assert fence == Fence(step=Seq(1))
    assert tracker.issue(STEP, Seq(2), write_device=blocks(7)) == Fence(swap=Seq(1))


def test_ops_of_one_lane_never_wait_for_their_own_lane():
    tracker = make_tracker()
    assert tracker.issue(STEP, Seq(1), write_device=blocks(7)) == NO_WAIT
    assert tracker.issue(STEP, Seq(2), read_device=blocks(7), write_device=blocks(7)) == NO_WAIT
    assert tracker.issue(SWAP, Seq(1), read_host=blocks(1), write_device=blocks(3)) == NO_WAIT
    assert tracker.issue(SWAP, Seq(2), read_device=blocks(3), write_host=blocks(1)) == NO_WAIT


def test_fences_of_one_lane_never_go_back():
    tracker = make_tracker()
    tracker.issue(SWAP, Seq(1), read_host=blocks(0), write_device=blocks(0))
    tracker.issue(SWAP, Seq(2), read_host=blocks(1), write_device=blocks(1))
    assert tracker.issue(STEP, Seq(1), read_device=blocks(1)) == Fence(swap=Seq(2))
    assert tracker.issue(STEP, Seq(2), read_device=blocks(0)) == Fence(swap=Seq(2))
    assert tracker.issue(STEP, Seq(3), read_device=blocks(5)) == Fence(swap=Seq(2))


def test_an_op_number_that_does_not_increase_raises_and_records_nothing():
    tracker = make_tracker()
    tracker.issue(STEP, Seq(1), read_device=blocks(2))
    with pytest.raises(ValueError, match=r"^step op numbers must increase: got 1 after 1$"):
        tracker.issue(STEP, Seq(1), write_device=blocks(3))
    assert tracker.issue(STEP, Seq(2)) == NO_WAIT  # the lane goes on after its last good op
    assert tracker.issue(SWAP, Seq(1), read_device=blocks(3), write_host=blocks(0)) == NO_WAIT


@pytest.mark.parametrize(
    ("lane", "touches", "message"),
    [
        (STEP, {"read_host": blocks(0)}, "a step op touches no host blocks: got some"),
        (STORE, {"write_device": blocks(0)}, "a store op touches no device blocks: got some"),
        (STEP, {"write_device": blocks(3, 8)}, r"device block ids must lie in \[0, 8\): got \[8\]"),
        (SWAP, {"read_host": blocks(-1, 2)}, r"host block ids must lie in \[0, 8\): got \[-1\]"),
    ],
)
def test_an_op_on_blocks_out_of_its_lane_or_range_raises_and_records_nothing(
    lane, touches, message
):
    tracker = make_tracker()
    with pytest.raises(ValueError, match=f"^{message}$"):
        tracker.issue(lane, Seq(1), **touches)
    assert tracker.issue(lane, Seq(1)) == NO_WAIT  # the refused number is still free
    assert tracker.issue(SWAP, Seq(2), read_device=blocks(3), write_host=blocks(2)) == NO_WAIT


def test_with_keep_access_each_op_declared_sets_are_taken_once_in_issue_order():
    tracker = FenceTracker(8, 8, keep_access=True)
    tracker.issue(STEP, Seq(1), read_device=blocks(5, 1), write_device=blocks(5))
    tracker.issue(SWAP, Seq(1), read_device=blocks(3), write_host=blocks(2, 0))
    tracker.issue(STEP, Seq(2), read_device=blocks(4))
    tracker.issue(STEP, Seq(3), write_device=blocks(6))
    assert tracker.take_access(SWAP, 1) == Access(1, (3,), (), (), (0, 2))
    assert tracker.take_access(SWAP, 1) is None  # taken
    # Step 1 never taken (an op dropped unsent): taking step 2 forgets it.
    assert tracker.take_access(STEP, 2) == Access(2, (4,), (), (), ())
    assert tracker.take_access(STEP, 1) is None
    assert tracker.take_access(STEP, 3) == Access(3, (), (6,), (), ())
    assert make_tracker().take_access(STEP, 1) is None  # kept only when asked


def holds(fence: Fence, done: dict[Lane, int]) -> bool:
    """Whether watermarks ``done`` let the op of ``fence`` run, as an executor decides."""
    return all(done[lane] >= seq for lane, seq in fence.waits().items())


def test_a_fence_lists_its_waits_and_holds_once_every_watermark_reaches_them():
    fence = Fence(step=Seq(5), store=Seq(2))
    assert fence.waits() == {STEP: 5, STORE: 2}
    assert NO_WAIT.waits() == {}
    assert holds(fence, {STEP: 5, SWAP: 0, STORE: 2})
    assert not holds(fence, {STEP: 5, SWAP: 9, STORE: 1})


# Execution: one executor per lane runs its ops in FIFO order; an op starts once its fence
# holds, touches its blocks until it finishes, and then advances its lane's watermark.


@dataclass(frozen=True, slots=True)
class Op:
    lane: Lane  # the lane that issues and runs it
    read_device: tuple[BlockId, ...] = ()  # the blocks it reads and writes, per tier
    write_device: tuple[BlockId, ...] = ()
    read_host: tuple[BlockId, ...] = ()
    write_host: tuple[BlockId, ...] = ()

    def conflicts_with(self, other: Op) -> bool:
        """Whether the two share a block that at least one of them writes."""
        (reads, writes), (other_reads, other_writes) = self.accesses(), other.accesses()
        return bool(writes & (other_reads | other_writes) or other_writes & reads)

    def accesses(self) -> tuple[set[tuple[Tier, BlockId]], set[tuple[Tier, BlockId]]]:
        """The (tier, block) pairs it reads, and those it writes."""
        d, h = Tier.DEVICE, Tier.HOST
        reads = {(d, b) for b in self.read_device} | {(h, b) for b in self.read_host}
        writes = {(d, b) for b in self.write_device} | {(h, b) for b in self.write_host}
        return reads, writes


Event = tuple[Literal["start", "finish"], Lane]


def issue_all(ops: Sequence[Op]) -> list[tuple[Seq, Fence]]:
    """Issue ``ops`` in order, numbering each lane 1, 2, ...; their numbers and fences."""
    tracker, numbers = make_tracker(3, 3), dict.fromkeys(Lane, 0)
    issued = []
    for op in ops:
        numbers[op.lane] += 1
        seq = Seq(numbers[op.lane])
        fence = tracker.issue(
            op.lane,
            seq,
            read_device=op.read_device,
            write_device=op.write_device,
            read_host=op.read_host,
            write_host=op.write_host,
        )
        issued.append((seq, fence))
    return issued


def execute(
    ops: Sequence[Op], issued: Sequence[tuple[Seq, Fence]], choose: Callable[[list[Event]], Event]
) -> list[tuple[str, int]]:
    """Run the ops as the executors would, ``choose`` picking each next event among those
    possible; the events as (start or finish, op index). Fails on a deadlock."""
    queues = {lane: deque(i for i, op in enumerate(ops) if op.lane is lane) for lane in Lane}
    running: dict[Lane, int] = {}
    done = dict.fromkeys(Lane, 0)  # the watermarks
    events: list[tuple[str, int]] = []
    while running or any(queues.values()):
        possible: list[Event] = [("finish", lane) for lane in Lane if lane in running]
        for lane in Lane:
            waiting = lane not in running and queues[lane]
            if waiting and holds(issued[queues[lane][0]][1], done):
                possible.append(("start", lane))
        assert possible, f"deadlock: watermarks {done}, queues {queues}"
        kind, lane = choose(possible)
        if kind == "start":
            i = running[lane] = queues[lane].popleft()
        else:
            i = running.pop(lane)
            done[lane] = issued[i][0]
        events.append((kind, i))
    return events


def conflicts_out_of_issue_order(
    ops: Sequence[Op], events: list[tuple[str, int]]
) -> list[tuple[int, int]]:
    """Pairs (a, b) of conflicting ops, a issued first, where b started before a finished."""
    at = {event: n for n, event in enumerate(events)}
    return [
        (a, b)
        for a, b in combinations(range(len(ops)), 2)
        if ops[a].conflicts_with(ops[b]) and at["start", b] < at["finish", a]
    ]


# Each kind of op takes two tuples of block ids: what it reads, then what it writes (a store
# op has one side only and ignores the second), so that generators can pick any kind.


def step(reads: tuple[BlockId, ...], writes: tuple[BlockId, ...]) -> Op:
    return Op(STEP, read_device=reads, write_device=writes)


def swap_in(host: tuple[BlockId, ...], device: tuple[BlockId, ...]) -> Op:
    return Op(SWAP, read_host=host, write_device=device)


def swap_out(device: tuple[BlockId, ...], host: tuple[BlockId, ...]) -> Op:
    return Op(SWAP, read_device=device, write_host=host)


def write_back(host: tuple[BlockId, ...], _: tuple[BlockId, ...] = ()) -> Op:
    return Op(STORE, read_host=host)


def prefetch(host: tuple[BlockId, ...], _: tuple[BlockId, ...] = ()) -> Op:
    return Op(STORE, write_host=host)


KINDS = (step, swap_in, swap_out, write_back, prefetch)


def random_ops(rng: random.Random, num_ops: int) -> list[Op]:
    def some() -> tuple[BlockId, ...]:
        return blocks(*rng.sample(range(3), rng.randint(1, 2)))

    return [rng.choice(KINDS)(some(), some()) for _ in range(num_ops)]


def test_fenced_execution_never_deadlocks_and_runs_conflicting_ops_in_issue_order(rng):
    for _ in range(300):
        ops = random_ops(rng, rng.randint(1, 25))
        events = execute(ops, issue_all(ops), rng.choice)
        assert sorted(i for kind, i in events if kind == "finish") == list(range(len(ops)))
        assert conflicts_out_of_issue_order(ops, events) == []


block_ids = st.lists(st.integers(0, 2), min_size=1, max_size=2, unique=True).map(
    lambda ids: blocks(*ids)
)
op_strategy = st.builds(
    lambda kind, first, second: kind(first, second), st.sampled_from(KINDS), block_ids, block_ids
)


@settings(max_examples=150, deadline=None, print_blob=True)
@given(ops=st.lists(op_strategy, max_size=20), scheduler=st.randoms(use_true_random=False))
def test_every_fenced_schedule_equals_the_sequential_execution(ops, scheduler):
    events = execute(ops, issue_all(ops), scheduler.choice)
    assert conflicts_out_of_issue_order(ops, events) == []


def test_without_fences_a_swap_out_can_read_a_block_before_the_step_writes_it():
    ops = [step(blocks(0), blocks(0)), swap_out(blocks(0), blocks(0))]
    issued = issue_all(ops)
    unfenced = [(seq, NO_WAIT) for seq, _ in issued]

    def last(possible: list[Event]) -> Event:  # the swap lane starts first when it may
        return possible[-1]

    assert conflicts_out_of_issue_order(ops, execute(ops, unfenced, last)) == [(0, 1)]
    assert conflicts_out_of_issue_order(ops, execute(ops, issued, last)) == []

"""The step gate: Worker ranks enter a step's collectives together, or all cancel it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from ringfence.actors.executors.ranks import GateOverdue, StepGate
from ringfence.actors.protocol.lanes import LANE_SLOTS, gate_counter, lane_counter
from ringfence.cache.fences import Lane
from ringfence.shm import names
from ringfence.shm.counter import CounterBlock
from ringfence.shm.doorbell import Doorbell

RANKS = 3


@pytest.fixture
def block(run_id: str) -> Iterator[CounterBlock]:
    made = CounterBlock.create(names.posix_name(run_id, "lanes"), LANE_SLOTS * RANKS)
    yield made
    made.close()
    names.clean_run(run_id)


def gates(block: CounterBlock) -> list[StepGate]:
    return [StepGate(block, rank, RANKS, []) for rank in range(RANKS)]


def test_a_rank_runs_a_step_only_once_every_peer_has_committed_to_it(block) -> None:
    first, second, third = gates(block)
    first.commit(1)
    second.commit(1)
    assert not first.settled(1)  # rank 2 has neither committed nor passed
    third.commit(1)
    assert all(g.settled(1) and g.passed_by(1) is None for g in (first, second, third))
    assert first.enter(1, lambda ready: ready()) == ""


def test_a_rank_that_passed_the_step_makes_every_committed_rank_cancel_it(block) -> None:
    first, second, _third = gates(block)
    first.commit(4)
    second.commit(4)
    lane_counter(block, 2, Lane.STEP).advance(4)  # rank 2 cancelled step 4 (stale, say)
    assert first.enter(4, lambda ready: ready()) == "rank 2 passed step 4 without running it"
    assert second.enter(4, lambda ready: ready()) == "rank 2 passed step 4 without running it"


def test_a_committed_peer_that_moved_on_is_not_taken_for_one_that_passed(block) -> None:
    """A peer whose gate is past the step but whose step_done is not has committed."""
    first, _second, _third = gates(block)
    gate_counter(block, 1).advance(7)
    gate_counter(block, 2).advance(7)
    assert first.enter(7, lambda ready: ready()) == ""


def test_a_rank_sleeps_on_its_doorbell_until_the_last_peer_commits(block, run_id) -> None:
    bell = Doorbell.create(names.posix_name(run_id, "bell.worker.0"))
    try:
        first = StepGate(block, 0, RANKS, [])
        peers = [StepGate(block, rank, RANKS, [bell]) for rank in (1, 2)]
        peers[0].commit(2)
        late = threading.Timer(0.2, peers[1].commit, args=(2,))
        late.start()
        assert first.enter(2, lambda ready: bell.wait_until(ready, 10.0)) == ""
        late.join(10.0)
    finally:
        bell.close()


def test_a_gate_wait_past_its_deadline_is_overdue_naming_the_missing_ranks(block) -> None:
    first, second, _third = gates(block)
    second.commit(3)
    with pytest.raises(GateOverdue, match=r"step 3: ranks \[2\] have neither entered nor passed"):
        first.enter(3, lambda ready: False)

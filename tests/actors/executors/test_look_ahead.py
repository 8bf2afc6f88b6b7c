"""The Worker's look-ahead (``actors/executors/look_ahead.py``): the next plan checked while a
step runs gives the verdict the check would give at the plan's turn, for that plan alone,
once. Launched with two steps in flight: ``tests/actors/engine/test_steps_in_flight_runs.py``."""

from __future__ import annotations

from collections.abc import Sequence

from builders import piece

from ringfence.actors.executors.look_ahead import CheckAhead
from ringfence.actors.protocol.resync import Resync
from ringfence.cache.fences import Fence
from ringfence.sched.ops import Piece, StepOp


def plan(step: int, *token_ids: int) -> StepOp:
    pieces = tuple(piece([t], 0, [step], seq_id=i) for i, t in enumerate(token_ids))
    return StepOp(step=step, fence=Fence(), pieces=pieces)


class Ahead:
    """A CheckAhead over a queue of what the engine sent, with a check that refuses token 0
    and counts its calls."""

    def __init__(self, *queue: object) -> None:
        self.queue, self.calls = list(queue), 0
        self.ahead = CheckAhead(lambda: self.queue[0] if self.queue else None, self.check)

    def check(self, pieces: Sequence[Piece]) -> None:
        self.calls += 1
        if any(0 in p.token_ids for p in pieces):
            raise ValueError("token id 0 is refused")


def test_a_plan_checked_ahead_gets_that_verdict_at_its_turn_once():
    good, bad = plan(2, 5, 6), plan(3, 0)
    rig = Ahead(good)
    assert rig.ahead.verdict(good) is None  # nothing checked yet: the caller checks
    rig.ahead.check_next()
    rig.ahead.check_next()  # peeked again, the same plan: checked once
    assert rig.calls == 1
    assert rig.ahead.verdict(plan(2, 5, 6)) is None  # an equal plan is not the one read ahead
    assert rig.ahead.verdict(good) == ""
    assert rig.ahead.taken == 2
    assert rig.ahead.verdict(good) is None  # given once
    rig.queue[:] = [bad]
    rig.ahead.check_next()
    assert rig.ahead.verdict(bad) == "token id 0 is refused"
    assert (rig.calls, rig.ahead.checked) == (2, 2)


def test_what_is_not_a_plan_with_pieces_is_not_checked():
    empty = StepOp(step=4, fence=Fence(), pieces=())
    rig = Ahead(Resync(epoch=1))
    rig.ahead.check_next()
    rig.queue[:] = [empty, None]
    rig.ahead.check_next()
    rig.queue.clear()
    rig.ahead.check_next()
    assert (rig.calls, rig.ahead.checked) == (0, 0)
    assert rig.ahead.verdict(empty) is None

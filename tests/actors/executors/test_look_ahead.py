"""The Worker's look-ahead (``actors/executors/look_ahead.py``): the next plan checked while a
step runs gives the verdict the check would give at the plan's turn, for that plan alone,
once; on a device, the look-ahead waits for that plan until the device is done. Launched
with two steps in flight: ``tests/actors/engine/test_steps_in_flight_runs.py``."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from builders import piece

from ringfence.actors.executors.look_ahead import CheckAhead, DeviceWatch, WorkAhead, choose_ahead
from ringfence.actors.protocol.resync import Resync
from ringfence.cache.fences import Fence
from ringfence.runtime.mailbox import ConditionWaiter
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


class Completion:
    """A step's device work that the test completes (or fails) when it chooses."""

    def __init__(self, error: Exception | None = None) -> None:
        self.released, self.error = threading.Event(), error

    def synchronize(self) -> None:
        assert self.released.wait(30.0), "the test never completed the device work"
        if self.error is not None:
            raise self.error


class Bell:
    """The Worker's doorbell, in-process, with its waits' outcomes (False: the deadline)."""

    def __init__(self) -> None:
        self.waiter, self.outcomes = ConditionWaiter(), list[bool]()

    def wait(self, ready: Callable[[], bool]) -> bool:
        self.outcomes.append(self.waiter.wait_until(ready, 30.0))
        return self.outcomes[-1]


def later(action: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=action)
    thread.start()
    return thread


def test_on_a_device_the_look_ahead_waits_for_the_next_plan_while_the_step_runs():
    bell, sent = Bell(), list[object]()
    ahead = CheckAhead(lambda: sent[0] if sent else None, lambda pieces: None, bell.wait)
    watch, work = DeviceWatch(bell.waiter), Completion()
    try:
        done = watch.watch(work)
        good = plan(2, 5)

        def send() -> None:  # the engine's frame, after the look-ahead began to wait
            sent.append(good)
            bell.waiter.ring()

        engine = later(send)
        ahead.check_next(done)  # returns on the frame: the device is still busy
        engine.join()
        assert bell.outcomes == [True] and not done()
        assert ahead.verdict(good) == ""
        work.released.set()
    finally:
        watch.close()
    assert done()


def test_the_look_ahead_stops_waiting_when_the_device_finishes_first():
    bell = Bell()
    ahead = CheckAhead(lambda: None, lambda pieces: None, bell.wait)
    watch, work = DeviceWatch(bell.waiter), Completion()
    try:
        done = watch.watch(work)
        device = later(work.released.set)
        ahead.check_next(done)  # no frame comes: the watch's ring ends the wait
        device.join()
        assert bell.outcomes == [True] and done() and ahead.checked == 0
        # Work that failed on the device still ends the wait: the Worker's own wait raises.
        failed = Completion(RuntimeError("device-side assert"))
        done = watch.watch(failed)
        device = later(failed.released.set)
        ahead.check_next(done)
        device.join()
        assert bell.outcomes == [True, True] and done()
        # and the watch goes on watching.
        after = Completion()
        done = watch.watch(after)
        device = later(after.released.set)
        ahead.check_next(done)
        device.join()
        assert bell.outcomes == [True, True, True] and done()
    finally:
        watch.close()


def test_without_a_device_to_wait_for_the_look_ahead_only_peeks():
    bell = Bell()
    rig = Ahead()
    rig.ahead = CheckAhead(lambda: rig.queue[0] if rig.queue else None, rig.check, bell.wait)
    rig.ahead.check_next()  # the CPU: the step is done when its kernels return
    assert bell.outcomes == [] and rig.calls == 0


def test_what_a_worker_does_ahead_follows_the_settings_the_device_and_its_ranks():
    # (look_ahead, launch_ahead, cuda, alone: one rank, not under the lock)
    assert choose_ahead("auto", "auto", True, True) == WorkAhead(True, True, True)  # a GPU's
    assert choose_ahead("auto", "auto", False, True) == WorkAhead(False, False, False)  # a CPU's
    assert choose_ahead("auto", "auto", True, False) == WorkAhead(True, False, False)  # tp, lock
    assert choose_ahead("auto", "late", True, True) == WorkAhead(True, True, False)
    assert choose_ahead("auto", "on", False, True) == WorkAhead(True, True, True)  # tests on a CPU
    assert choose_ahead("auto", "off", True, True) == WorkAhead(True, False, False)
    assert choose_ahead("off", "auto", True, True) == WorkAhead(False, False, False)
    assert choose_ahead("on", "auto", False, True) == WorkAhead(True, False, False)

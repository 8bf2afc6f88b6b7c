"""What every lane executor shares: its watermark, fence waits, lane order, completions.

Three lanes run per rank (docs/design.md, "Sequence numbers, watermarks, fences"): ``step``
(the Worker), ``swap`` and ``store`` (the two Transfer lanes). Each is executed in
issue order by exactly one actor, which publishes how far it got in the ``lanes``
counter block of the run (its layout: ``actors/protocol/lanes.py``: step_done,
swap_done, store_done, and the two epochs below). :class:`LaneExecutor` is the base of the
three: for an op numbered ``n`` it tells a repeat (``n <= done``: answered with the
kept completion) and a hole in the lane (``n > done + 1``: refused, the watermark
stays) from the next op; waits, sleeping on its own doorbell, until every other
lane's watermark has reached the op's fence; and completes an op by advancing its
watermark *before* it reports, so a completion never announces work that a crash
could still undo.

Epochs. Every op carries the epoch its issuer stamped on it. Two counters per rank
say which epochs are past: ``tier_epoch``, written by the Worker as the first thing it
does on every start (a restarted Worker has a fresh device tier: the blocks every
earlier op named hold nothing), and ``issuer_epoch``, written by the Engine when it
starts (a restarted Engine knows nothing of the ops its predecessor issued). An op
whose epoch is below either is *stale*: it is cancelled, never executed. The check is
made after the fence wait, right before the op touches a block, and that order is
what makes a Worker restart safe: the new Worker writes ``tier_epoch`` before it
cancels the step its predecessor left unfinished (which advances ``step_done``), so an
op that waited for that step and sees ``step_done`` past it also sees the new epoch
(stores of one writer are seen in order, loads are not reordered with loads) and is
cancelled instead of copying what that step never wrote. A restart of a Transfer lane
bumps neither counter: its ops stay valid and are redone from its ring.

A fence wait that runs past the deadline (half the heartbeat timeout) cancels a stale
op, and otherwise hands it back to the driver to be tried again after a heartbeat
(``msg.deferred``): nothing waits forever on a dead peer.
``transfer.skip_fences`` (debug only) skips every wait, so that tests can show they
would catch a missing fence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import ClassVar

from ringfence.actors.executors.config import LaneSettings
from ringfence.actors.executors.legacy import LegacyLock, lock_path
from ringfence.actors.executors.profiling import LaneProfile, profile_path
from ringfence.actors.executors.touches import Touches
from ringfence.actors.protocol.lanes import (
    ISSUER_EPOCH,
    LANES,
    TIER_EPOCH,
    epoch_counter,
    lane_counter,
)
from ringfence.cache.fences import Fence, Lane
from ringfence.runtime.actor import Actor
from ringfence.shm.counter import Watermark

# The actor executing each lane, and the actors that wait on its watermark (and so are
# rung after each advance): a swap-out waits for steps (I2), a step for swap-ins (I1,
# I3), a write-back for swap-outs and a swap-in for prefetches (I4).
EXECUTOR = {Lane.STEP: "worker", Lane.SWAP: "swap", Lane.STORE: "store"}
WAITERS = {Lane.STEP: ("swap",), Lane.SWAP: ("worker", "store"), Lane.STORE: ("swap",)}


class Cancelled(Exception):
    """The op will not run: its fence was not reached and its epoch has passed, or it was
    issued for a tier that has been reset since."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class LaneExecutor(Actor):
    """Base of the Worker and the Transfer lanes: one lane, executed in order."""

    config_section = LaneSettings  # only the sections the lanes read
    lane: ClassVar[Lane]

    def on_start(self) -> None:
        config = self.ctx.config
        assert isinstance(config, LaneSettings)
        self.config = config
        self.skip_fences = config.transfer.skip_fences
        block = self.ctx.counters.get(LANES)
        if block is None:
            raise RuntimeError(f"the topology has no {LANES!r} counter block for the watermarks")
        rank = self.ctx.rank
        self.marks = {lane: lane_counter(block, rank, lane) for lane in Lane}
        self.done = self.marks[self.lane]
        bells = [self.bell_of(instance) for instance in self.waiters()]
        self.done.claim(notify=[bell for bell in bells if bell is not None])
        self.epochs = [epoch_counter(block, rank, which) for which in (TIER_EPOCH, ISSUER_EPOCH)]
        self.last: object | None = None  # the last completion sent, to answer a repeat
        self.last_op = 0
        self.touches: Touches | None = None  # the running op's, at trace level (touches.py)
        self.legacy: LegacyLock | None = None
        self.profile: LaneProfile | None = None  # transfer.profile: started at the first op
        run_dir = self.ctx.run_dir
        if config.transfer.profile and run_dir is not None and self.ctx.placement != "hosted":
            path = profile_path(run_dir, self.ctx.instance, self.ctx.incarnation)
            self.profile = LaneProfile(path, cuda=config.model.device.startswith("cuda"))
        if config.transfer.mode == "lock":
            if self.ctx.run_dir is None:
                raise RuntimeError("transfer.mode=lock needs a run dir for its lock file")
            path = lock_path(self.ctx.run_dir, rank)
            self.legacy = LegacyLock(path, config.transfer.lock_timeout_s)

    def on_stop(self) -> None:
        if self.profile is not None:
            self.profile.stop()
        if self.legacy is not None:
            waited = self.legacy.wait_ns / 1e6
            self.log.info("legacy.lock", waits=self.legacy.waits, wait_ms=round(waited, 3))
            self.legacy.close()
            self.legacy = None

    @contextlib.contextmanager
    def executing(self, name: str) -> Iterator[None]:
        """Around the work of op ``name`` (``step 12``, ``swap-out 4``: profiling.op_range):
        the legacy lock held (``transfer.mode = lock``), and a profiler range
        (``transfer.profile``, its profiler started before the first op)."""
        profile = self.profile
        if profile is not None and not profile.started:
            profile.start()  # not before: a Worker's model load would fill it
        ranged = contextlib.nullcontext() if profile is None else profile.range(name)
        held = contextlib.nullcontext() if self.legacy is None else self.legacy.held()
        with held, ranged:
            yield

    def waiters(self) -> list[str]:
        """The instances that wait on this lane's watermark (rung after each advance): the
        other lanes of this rank that :data:`WAITERS` names."""
        return [f"{name}-{self.ctx.rank}" for name in WAITERS[self.lane]]

    def order(self, op: int) -> str:
        """``"next"``, ``"repeat"`` (at or below the watermark) or ``"hole"`` (past the next)."""
        done = self.done.value()
        if op <= done:
            return "repeat"
        return "next" if op == done + 1 else "hole"

    def stale(self, epoch: int) -> str:
        """Why an op of ``epoch`` must not run (its device tier or its issuer is gone), or ""."""
        tier, issuer = (mark.value() for mark in self.epochs)
        if epoch < tier:
            return f"op of epoch {epoch} names blocks of the device tier reset at epoch {tier}"
        if epoch < issuer:
            return f"op of epoch {epoch} was issued before the engine restarted at epoch {issuer}"
        return ""

    def fence_problem(self, fence: Fence) -> str:
        """Why ``fence`` cannot be an op's fence in this lane, or "": it may not name the
        lane itself (the lane's FIFO orders its ops; waiting on itself would never end)."""
        own = fence.waits().get(self.lane)
        return f"the fence of a {self.lane} op names its own lane ({own})" if own else ""

    def fence_met(self, fence: Fence) -> bool:
        """Whether every other lane's watermark has reached ``fence`` already (no wait)."""
        waits = fence.waits().items()
        return self.skip_fences or all(self.marks[lane].value() >= to for lane, to in waits)

    def wait_fence(self, op: int, epoch: int, fence: Fence) -> dict[Lane, int]:
        """Sleep until every other lane's watermark reaches ``fence``; the values then seen
        of every other lane.

        Raises :class:`Cancelled` when the op is stale (see :meth:`stale`), checked when a
        wait runs past its deadline and again once the fence is reached (after the
        watermarks were read: see the module docstring); ``WaitTimeout`` (or
        ``ActorDead``) to have it handed over later.
        """
        problem = self.fence_problem(fence)
        if problem:  # callers reject such an op before they wait (see fence_problem)
            raise ValueError(problem)
        seen = {}
        for lane, target in fence.waits().items():
            mark = self.marks[lane]
            if not self.skip_fences and mark.value() < target:

                def reached(mark: Watermark = mark, target: int = target) -> bool:
                    return mark.value() >= target

                if not self.wait_until(reached):
                    if stale := self.stale(epoch):
                        raise Cancelled(stale)
                    raise mark.overdue(target, f"for {self.lane} op {op}")
            seen[lane] = mark.value()
        # Every other lane's watermark as it stands before the op touches a block, fenced
        # or not: replay proves each cross-lane ordering from these (I1-I4), not from the
        # fence, so a fence too weak or not waited for shows up.
        for lane, mark in self.marks.items():
            if lane is not self.lane and lane not in seen:
                seen[lane] = mark.value()
        # Read after the watermarks: a step the new Worker cancelled is seen as done only
        # together with the epoch that makes this op stale.
        if stale := self.stale(epoch):
            raise Cancelled(stale)
        return seen

    def begin_touches(self) -> Touches | None:
        """A fresh record of the blocks the op about to run touches (None unless tracing)."""
        self.touches = Touches() if self.log.tracing else None
        return self.touches

    def log_touches(self, op: int, epoch: int) -> None:
        """``op.touched`` with what the op that just ran touched (when tracing), once."""
        if self.touches is not None:
            touched, self.touches = self.touches.fields(), None
            self.log.trace(
                "op.touched",
                lane=str(self.lane),
                op=op,
                op_epoch=epoch,
                reads=touched["reads"],
                writes=touched["writes"],
            )

    def complete(self, op: int, report: object) -> None:
        """Publish op ``op`` done, then send ``report`` to the engine (kept for repeats)."""
        self.done.advance(op)
        self.last, self.last_op = report, op
        self.send("engine", report)

    def kept(self, op: int) -> object | None:
        """The completion sent for ``op`` if it was this incarnation's last one, else None."""
        return self.last if self.last is not None and self.last_op == op else None

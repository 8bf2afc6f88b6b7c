"""The Worker actor: runs the Engine's step plans on the model and the device KV tensor.

One Worker per rank executes the step lane (docs/design.md, "Sequence numbers,
watermarks, fences") strictly in order, ``s = 1, 2, ...``. For each plan it

1. refuses a malformed plan before touching anything (unknown or repeated block id,
   a block table longer than the pool or too short for the positions, a position past
   the model's maximum, a token outside the vocabulary): result ``rejected``;
2. waits, sleeping on its own doorbell, until every watermark named in the plan's
   fence has reached it: a step never reads a block before the swap-in that fills it
   is done (I1), and the swap-outs and write-backs it must not overtake are done (I3);
3. puts in the tokens its last step sampled for the decodes planned before them (a
   plan naming tokens it lacks fails: pending.py), fills the plan's ``poison`` blocks
   with NaN, runs the pieces as one mixed batch, samples the next token of every piece
   that asks for one (non-finite logits fail the step); a step that raises fills the
   blocks it was writing with NaN, so that nothing fenced on it copies half-computed
   KV as valid (see ``actors/executors/transfer.py``);
4. advances ``step_done`` (every step <= s finished, KV writes included) and only
   then sends the :class:`StepResult` with the step number and the plan's epoch.

On a GPU the next plan's steps 1-3 may run before this step's 4 (``model.launch_ahead``):
its kernels are queued while this step lands, checked ahead and with its fence already met,
its pending tokens taken from this step's draw on the device; if this step then fails, so
does that one, spoiled (:class:`LaunchedBehindFailure`). Only ``step_done`` moves later.

A plan of a past epoch (lanes.py: issued before this Worker started, or by an engine
that has restarted since) is cancelled, never run: watermark advanced past it, result
``cancelled``. A fence wait that runs past its deadline cancels a stale plan and
otherwise hands it over again later (the driver's ``msg.deferred``), with heartbeats
in between. The Worker publishes its start epoch as ``tier_epoch`` before it handles
any plan: a restarted Worker has a fresh device tier, and every op issued before
names blocks of the old one.

Delivery is at least once (a plan whose step was cut short by a crash is read again),
and the step number makes it exactly once: a plan at or below ``step_done`` is a
repeat, answered with the kept result when it is the last step, else dropped.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from ringfence.actors.executors.device_step import (
    NOTHING_SAMPLED,
    DeviceStep,
    Launched,
    LaunchNext,
    written_blocks,
)
from ringfence.actors.executors.lanes import Cancelled, LaneExecutor
from ringfence.actors.executors.look_ahead import CheckAhead, DeviceWatch, choose_ahead
from ringfence.actors.executors.pending import MissingToken, SampledTokens, on_device
from ringfence.actors.executors.profiling import op_range
from ringfence.actors.executors.ranks import GroupFailed, StepGate, join_ranks
from ringfence.actors.executors.sampling import Draw, NonFiniteLogits
from ringfence.actors.model.inputs import DeviceInputs
from ringfence.actors.model.loader import load_model
from ringfence.actors.model.parallel import Shard
from ringfence.actors.protocol.lanes import LANES
from ringfence.actors.protocol.resync import Resync
from ringfence.actors.protocol.worker import (
    PromptLogprobs,
    Sampled,
    StepResult,
    StepStatus,
    WorkerReady,
)
from ringfence.cache.fences import Lane
from ringfence.runtime.actor import handles
from ringfence.runtime.mailbox import Delivery
from ringfence.sched.ops import StepOp
from ringfence.shm.errors import RingfenceError


class Settled(NamedTuple):
    """A step's figures for its ``step.done`` line, taken as it ends."""

    forward_ns: int | None
    sample_ns: int | None
    reduce_ns: int | None
    reduces: int
    checked_ahead: bool


class StaleLaunch(RingfenceError):
    """A step launched ahead whose epoch went stale before its turn: it ran, so it fails."""


class LaunchedBehindFailure(RingfenceError):
    """A step launched before the step before it was landed, which then failed: it ran on
    what that step computed (its tokens, its KV), so it fails too, its writes spoiled."""


class Worker(LaneExecutor):
    """The model and the device KV tensor of one rank; the step lane's only executor."""

    lane = Lane.STEP

    def on_start(self) -> None:
        super().on_start()
        # First of all: every op issued for the previous incarnation's device tier is
        # stale from now on (lanes.py: why this comes before any plan is cancelled).
        tier_epoch = self.epochs[0]
        tier_epoch.claim()
        tier_epoch.advance(self.ctx.epoch)
        config, rank = self.config, self.ctx.rank
        self.shard = Shard(rank, config.parallel.tp_size)
        self.gate = self._step_gate() if self.shard.size > 1 else None
        device, ctx = self.config.model.device, self.ctx
        self.group = join_ranks(
            self.shard, device, ctx.run_dir, ctx.incarnation, ctx.runtime.ready_timeout_s, self.log
        )
        self.model, self.info = load_model(config.model, shard=self.shard, group=self.group)
        self.device = DeviceStep.open(config, self.model, self.ctx.run_id, self.log)
        self.executor, self.sampler = self.device.executor, self.device.sampler
        cuda = self.device.cuda
        # Launching ahead is off under tensor parallelism and the lock (preflight.py).
        alone = self.shard.size == 1 and config.transfer.mode != "lock"
        ahead = choose_ahead(config.model.look_ahead, config.model.launch_ahead, cuda, alone)
        self.ahead = self.device.ahead = (
            CheckAhead(lambda: self.peek("engine"), self.executor.check, self.wait_until)
            if ahead.check
            else None
        )  # look_ahead.py; launching ahead takes the plans it checked
        # On CUDA the look-ahead waits for the next plan until the device is done: this
        # thread rings the Worker's doorbell when it is.
        self.device.watch = DeviceWatch(self.own_bell()) if self.ahead and cuda else None
        self.launch_ahead, self.launch_early = ahead.launch, ahead.early
        self.launched: Launched | None = None  # the next step, launched ahead
        self.ok_step = 0  # the last step that ran ok (what a step launched behind it needs)
        self.forgotten = 0  # the last step whose closed sequences were forgotten
        self.steps = 0
        self.sampled = SampledTokens()  # the last step's tokens, for plans made before them
        space = self.device.space
        self.log.info(
            "worker.ready",
            model_id=self.info.model_id,
            device=space.handle.device,
            kv_shm=space.handle.shm,
            num_blocks=space.handle.layout.num_blocks,
            block_bytes=space.handle.layout.block_bytes,
            step_done=self.done.value(),
            threads=torch.get_num_threads(),
            tp_size=self.shard.size,
            group=self.ctx.incarnation,
        )
        self.announce()

    def waiters(self) -> list[str]:
        """Besides this rank's swap lane, the other Worker ranks: their step gates read
        this rank's step_done (ranks.py)."""
        rank, size = self.ctx.rank, self.config.parallel.tp_size
        return [*super().waiters(), *(f"worker-{p}" for p in range(size) if p != rank)]

    def _step_gate(self) -> StepGate:
        """This rank's step gate (ranks.py): a commit rings the other ranks."""
        rank, size = self.shard.rank, self.shard.size
        bells = [self.bell_of(f"worker-{p}") for p in range(size) if p != rank]
        peers = [bell for bell in bells if bell is not None]
        return StepGate(self.ctx.counters[LANES], rank, size, peers)

    def announce(self, resync: int = -1) -> None:
        """Send WorkerReady: on start, and in answer to an engine's Resync."""
        self.send(
            "engine",
            WorkerReady(
                rank=self.ctx.rank,
                epoch=self.ctx.epoch,
                incarnation=self.ctx.incarnation,
                step_done=self.done.value(),
                model=self.info,
                kv=self.device.space.handle,
                resync=resync,
            ),
        )

    @handles(Resync)
    def on_resync(self, msg: Resync) -> None:
        self.announce(resync=msg.epoch)

    def on_stop(self) -> None:
        super().on_stop()
        device: DeviceStep | None = getattr(self, "device", None)  # None if on_start failed early
        if device is not None:
            device.close()
        self.group.close()

    @property
    def kv(self) -> torch.Tensor:
        return self.device.space.kv

    def on_failure(self, error: Exception, delivery: Delivery) -> None:
        """A rank whose step failed in its collectives dies, its plan left on the ring."""
        if isinstance(error, GroupFailed):
            raise error

    @handles(StepOp)
    def on_plan(self, plan: StepOp) -> None:
        order = self.order(plan.step)
        if order == "repeat":
            kept = self.kept(plan.step)
            resent = kept is not None
            self.log.warning("step.repeat", step=plan.step, plan_epoch=plan.epoch, resent=resent)
            if kept is not None:
                self.send("engine", kept)
            return
        if order == "hole":  # running it would claim that the missing steps were done
            error = f"step {plan.step} arrived when {self.done.value() + 1} is next"
            self.log.error("step.refused", step=plan.step, plan_epoch=plan.epoch, error=error)
            self.send(
                "engine",
                StepResult(
                    step=plan.step,
                    epoch=plan.epoch,
                    rank=self.ctx.rank,
                    status="rejected",
                    error=error,
                ),
            )
            return
        launched, self.launched = self.launched, None
        if launched is not None:  # its kernels were queued as the step before it finished
            self._land_ahead(plan, launched)
            return
        # Stale first: a plan issued for the tier before this restart names sequences this
        # incarnation never opened, which would read as malformed; it is merely too old.
        if stale := self.stale(plan.epoch):
            self._finish(plan, "cancelled", error=stale)
            return
        problem = self._problem(plan)
        if problem:
            self._finish(plan, "rejected", error=problem)
            return
        started = time.perf_counter_ns()
        try:
            seen = self.wait_fence(plan.step, plan.epoch, plan.fence)
        except Cancelled as e:
            self._finish(plan, "cancelled", error=e.reason)
            return
        if self.gate is not None and plan.pieces:  # the forward holds collectives
            passed = self.gate.enter(plan.step, self.wait_until)
            if passed:
                self._finish(plan, "cancelled", error=passed)
                return
        waited = time.perf_counter_ns()
        self.begin_touches()
        try:
            with self.executing(op_range("step", plan.step)):
                plan = self.sampled.resolve(plan)  # the last step's tokens put in (pending.py)
                outputs, prompt_logprobs = self.device.execute(
                    plan, self.touches, self._launcher(plan)
                )
        except Exception as e:  # it ran part way: the lane moves on, the engine is told
            self._fail(plan, e)
            return
        self._succeed(plan, outputs, prompt_logprobs, seen, started, waited)

    def _succeed(  # noqa: PLR0917
        self,
        plan: StepOp,
        outputs: Sampled,
        prompt_logprobs: tuple[PromptLogprobs, ...],
        seen: dict[Lane, int],
        started: int,
        waited: int,
        *,
        ahead: str | None = None,
    ) -> None:
        """Report a step that ran, queuing the next step's kernels first where it may
        (:meth:`_launch_next`): the report and the next plan's turn then run beside it."""
        exec_ns = time.perf_counter_ns() - waited
        self.ok_step = plan.step
        settled = self._settle(plan, outputs)
        self._launch_next(plan)
        self._report(
            plan,
            "ok",
            settled,
            outputs=outputs,
            prompt_logprobs=prompt_logprobs,
            wait_ns=waited - started,
            exec_ns=exec_ns,
            seen_swap=seen.get(Lane.SWAP),
            seen_store=seen.get(Lane.STORE),
            launched_ahead=ahead,
        )

    def _fail(self, plan: StepOp, e: Exception) -> None:
        """A step that raised part way: what it was writing is spoiled, the engine told."""
        # What it wrote is spoiled before step_done moves: a swap-out or write-back
        # fenced on this step must not copy half-computed KV as if it were valid.
        # Raising here, the Worker dies first and its restart resets the device tier.
        spoiled = written_blocks(plan, self.executor.block_size)
        self.device.space.poison(spoiled)
        self.device.touched(self.touches)  # what the model's step indexed, if it got that far
        if self.touches is not None:
            self.touches.write("device", spoiled)
        self.log.error(
            "step.failed", step=plan.step, error=repr(e), spoiled=len(spoiled), exc_info=e
        )
        if self.shard.size > 1 and not isinstance(e, NonFiniteLogits):
            # The peers are inside (or past) this step's collectives and cannot be told:
            # the group goes down together and restarts. Answered or taken off the ring
            # here, the plan would be lost to this rank's next generation, whose step_done
            # would then never pass it (a swap fenced on it waited forever).
            rank = f"rank {self.shard.rank} of {self.shard.size}"
            raise GroupFailed(f"step {plan.step} failed at {rank}: {e!r}") from e
        self._finish(plan, "failed", error=f"{type(e).__name__}: {e}")

    def _launchable(self, before: StepOp) -> StepOp | None:
        """The plan read ahead, if it is the step after ``before``, passed its check, is of a
        current epoch and its fence is met already (nothing to wait for: a wait here would
        hold the report of the step that it may be waiting on); else None."""
        if not self.launch_ahead or self.ahead is None or self.launched is not None:
            return None
        plan = self.ahead.passed()
        if plan is None or plan.step != before.step + 1 or self.stale(plan.epoch):
            return None
        return plan if self.fence_met(plan.fence) else None

    def _launcher(self, landing: StepOp) -> LaunchNext | None:
        """What launches the next plan while ``landing``'s work is still on the device."""
        if not self.launch_early:
            return None
        return lambda draw: self._launch_early(landing, draw)

    def _launch_early(self, landing: StepOp, draw: Draw | None) -> None:
        """Queue the next plan's kernels behind ``landing``'s before its tokens are read
        back, its pending inputs gathered from ``draw`` on the device (pending.on_device),
        so that the device goes from one step to the next without waiting for the host.
        Not for a plan whose inputs name another step, nor while a grammar is open (its
        matcher reads the tokens on the host): those wait for :meth:`_launch_next`."""
        plan = self._launchable(landing)
        if plan is None or self.sampler.constrained:
            return
        inputs = on_device(plan, landing.step, draw)
        if inputs is None and any(p.pending_from for p in plan.pieces):
            return
        # What landing's end forgets, forgotten first: the next plan may open such a
        # sequence again, which forgetting it after would undo.
        self._forget(landing)
        self._launch(plan, plan, inputs, behind=landing.step)

    def _launch_next(self, finished: StepOp) -> None:
        """Queue the kernels of the plan read ahead (:meth:`_launchable`), its inputs from
        ``finished``'s tokens, on the host by now. A launch that raises fails that step at
        its turn."""
        plan = self._launchable(finished)
        if plan is None:
            return
        try:
            resolved = self.sampled.resolve(plan)
        except MissingToken:
            return  # it fails at its turn, as any plan missing a token does
        self._launch(plan, resolved, None, behind=0)

    def _launch(
        self, plan: StepOp, ready: StepOp, inputs: DeviceInputs | None, *, behind: int
    ) -> None:
        """Launch ``plan`` ahead (as ``ready``: its pending inputs put in, or in ``inputs``),
        keeping what its turn reads: its watermarks, clocks, timer marks and touches."""
        if self._problem(plan):  # rejected at its turn (the check ahead's verdict is given)
            return
        started = time.perf_counter_ns()
        try:
            seen = self.wait_fence(plan.step, plan.epoch, plan.fence)  # met: reads the marks
        except Cancelled:
            return
        waited = time.perf_counter_ns()
        # The landing step's marks and touches are put back after: this step keeps its own.
        marks, touches = self.device.timer.swap([]), self.touches
        self.begin_touches()
        try:
            with self.executing(op_range("step", plan.step)):
                launched = self.device.launch(ready, self.touches, inputs)
        except Exception as e:  # its turn fails it, as if it had raised there
            launched = Launched(plan=ready, error=e)
        self.launched = launched._replace(
            seen=seen,
            started=started,
            waited=waited,
            behind=behind,
            marks=self.device.timer.swap(marks),
            touches=self.touches,
        )
        self.touches = touches

    def _land_ahead(self, plan: StepOp, launched: Launched) -> None:
        """The turn of a plan whose kernels were queued ahead: its tokens collected and the
        step reported. Its checks, fence wait and inputs were done at the launch."""
        if launched.plan.step != plan.step:  # the peeked frame is the one handed next
            raise RuntimeError(f"step {launched.plan.step} was launched ahead of {plan.step}")
        self.touches = launched.touches
        self.device.timer.swap(launched.marks or [])
        try:
            with self.executing(op_range("step", plan.step)):
                if launched.error is not None:
                    raise launched.error
                if launched.behind and self.ok_step != launched.behind:
                    self.device.wait(launched)  # it ran: done before its blocks are spoiled
                    raise LaunchedBehindFailure(
                        f"step {plan.step} was launched while step {launched.behind} was "
                        f"on the device, and step {launched.behind} did not run ok"
                    )
                # Stale since its launch (the engine restarted): it ran, so it is spoiled.
                if stale := self.stale(plan.epoch):
                    self.device.wait(launched)
                    raise StaleLaunch(stale)
                outputs, prompt_logprobs = self.device.land(launched, self._launcher(plan))
        except Exception as e:
            self._fail(launched.plan, e)
            return
        started, waited = launched.started, launched.waited
        seen = launched.seen or {}
        ahead = "early" if launched.behind else "late"
        self._succeed(launched.plan, outputs, prompt_logprobs, seen, started, waited, ahead=ahead)

    def _problem(self, plan: StepOp) -> str:
        """Why the plan must not run, or "": its fence, then what the device tier says."""
        return self.fence_problem(plan.fence) or self.device.problem(plan)

    def _finish(self, plan: StepOp, status: StepStatus, *, error: str = "") -> None:
        """Advance step_done past a plan that did not run whole, then report it."""
        self._report(plan, status, self._settle(plan, NOTHING_SAMPLED), error=error)

    def _settle(self, plan: StepOp, outputs: Sampled) -> Settled:
        """What a step's end changes in the Worker, before anything of the next step: its
        tokens kept for the next plan, its closed sequences forgotten, its touches logged
        and its timings taken."""
        self.steps += 1
        self.sampled.keep(plan.step, zip(outputs.seq_ids, outputs.token_ids, strict=True))
        self._forget(plan)
        self.log_touches(plan.step, plan.epoch)
        reduce_ns, reduces = self.group.take_reduce_ns()
        forward_ns, sample_ns = self.device.timer.take()
        checked = self.ahead is not None and self.ahead.given(plan.step)
        return Settled(forward_ns, sample_ns, reduce_ns if reduces else None, reduces, checked)

    def _forget(self, plan: StepOp) -> None:
        """Forget the plan's closed sequences, once: whatever the status, forgetting is
        always safe, and a step launched early forgets them before the plan ends."""
        if self.forgotten != plan.step:
            self.sampler.close(plan.closed)
            self.executor.forget(plan.closed)  # the tables its check kept
            self.forgotten = plan.step

    def _report(
        self,
        plan: StepOp,
        status: StepStatus,
        settled: Settled,
        *,
        outputs: Sampled = NOTHING_SAMPLED,
        prompt_logprobs: tuple[PromptLogprobs, ...] = (),
        error: str = "",
        wait_ns: int = 0,
        exec_ns: int = 0,
        seen_swap: int | None = None,
        seen_store: int | None = None,
        launched_ahead: str | None = None,
    ) -> None:
        """Advance step_done past the plan, then report it."""
        self.log.info(
            "step.done",
            step=plan.step,
            plan_epoch=plan.epoch,
            status=status,
            fence_swap=plan.fence.swap,
            fence_store=plan.fence.store,
            seen_swap=seen_swap,
            seen_store=seen_store,
            pieces=len(plan.pieces),
            tokens=sum(len(p.token_ids) for p in plan.pieces),
            poison=len(plan.poison),
            wait_ns=wait_ns,
            exec_ns=exec_ns,
            reduce_ns=settled.reduce_ns,
            reduces=settled.reduces or None,
            forward_ns=settled.forward_ns,
            sample_ns=settled.sample_ns,
            checked_ahead=settled.checked_ahead,
            launched_ahead=launched_ahead,
            error=error or None,
        )
        result = StepResult(
            step=plan.step,
            epoch=plan.epoch,
            rank=self.ctx.rank,
            status=status,
            sampled=outputs,
            prompt_logprobs=prompt_logprobs,
            error=error,
            wait_ns=wait_ns,
            exec_ns=exec_ns,
        )
        self.complete(plan.step, result)

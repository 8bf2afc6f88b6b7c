"""The Worker actor: runs the Engine's step plans on the model and the device KV tensor.

One Worker per rank executes the step lane (DESIGN.md "Sequence numbers,
watermarks, fences") strictly in order, ``s = 1, 2, ...``. For each plan it

1. refuses a malformed plan before touching anything (unknown or repeated block id,
   a block table longer than the pool or too short for the positions, a position past
   the model's maximum, a token outside the vocabulary): result ``rejected``;
2. waits, sleeping on its own doorbell, until every watermark named in the plan's
   fence has reached it: a step never reads a block before the swap-in that fills it
   is done (I1), and the swap-outs and write-backs it must not overtake are done (I3);
3. fills the plan's ``poison`` blocks with NaN, runs the pieces as one mixed batch,
   samples the next token of every piece that asks for one;
4. advances ``step_done`` (every step <= s finished, KV writes included) and only
   then sends the :class:`StepResult` with the step number and the plan's epoch.

A fence wait that runs past its deadline re-reads the run epoch: a plan of an older
epoch is cancelled (watermark advanced past it, result ``cancelled``), otherwise the
plan is handed over again later (the driver's ``msg.deferred``), with heartbeats in
between. Plans issued before this incarnation started are cancelled at once: a
restarted Worker has a fresh device tier, and they name blocks of the old one.

Delivery is at least once (a plan whose step was cut short by a crash is read again),
and the step number makes it exactly once: a plan at or below ``step_done`` is a
repeat, answered with the kept result when it is the last step, else dropped.
"""

from __future__ import annotations

import time
from typing import ClassVar, NamedTuple

import torch

from ringfence.actors.checkpoint import checkpoint_fingerprint_id, load_checkpoint, special_ids
from ringfence.actors.kvspace import KVLayout, SharedKV, create_kv, torch_dtype
from ringfence.actors.model import Model, sample
from ringfence.actors.paged import PagedExecutor, Piece
from ringfence.actors.protocol import (
    ModelInfo,
    PlanPiece,
    SampledToken,
    StepPlan,
    StepResult,
    StepStatus,
    WorkerReady,
)
from ringfence.actors.tokenizer import ByteTokenizer
from ringfence.cache.fences import Lane
from ringfence.runtime.actor import Actor, handles
from ringfence.runtime.config import Config
from ringfence.runtime.config import ModelConfig as ModelSettings
from ringfence.shm.counter import CounterBlock, Watermark
from ringfence.shm.names import posix_name

LANES = "lanes"  # the topology's counter block of the lane watermarks
LANE_SLOTS = 4  # counters per rank in it: step_done, swap_done, store_done, one spare
_LANE_SLOT = {Lane.STEP: 0, Lane.SWAP: 1, Lane.STORE: 2}


def lane_counter(block: CounterBlock, rank: int, lane: Lane) -> Watermark:
    """The watermark of ``lane`` at ``rank`` in the ``lanes`` counter block."""
    index = rank * LANE_SLOTS + _LANE_SLOT[lane]
    if index >= block.count:
        raise ValueError(f"rank {rank} has no {lane} watermark in a block of {block.count}")
    return block[index]


class LoadedModel(NamedTuple):
    model: Model
    info: ModelInfo


def load_model(settings: ModelSettings) -> LoadedModel:
    """The model the ``[model]`` section names: ``path`` (a checkpoint) before ``preset``."""
    dtype = torch_dtype(settings.dtype)
    device = settings.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"model.device is {device!r} but torch sees no CUDA device")
    if settings.path:
        model = load_checkpoint(settings.path, dtype=dtype, device=device)
        model_id = checkpoint_fingerprint_id(settings.path)
        bos, eos = special_ids(settings.path)
    else:
        model = Model.from_preset(settings.preset, dtype, settings.seed).to(device)
        model_id = f"preset-{settings.preset}-seed{settings.seed}"
        bos, eos = ByteTokenizer.bos, ByteTokenizer.eos
    info = ModelInfo(
        model_id=model_id,
        vocab_size=model.config.vocab_size,
        max_position=model.config.max_position,
        dtype=settings.dtype,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    return LoadedModel(model.eval(), info)


class _Cancelled(Exception):
    """A fence that will never be reached: the plan's epoch has passed."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Worker(Actor):
    """The model and the device KV tensor of one rank; the step lane's only executor."""

    config_section = ""  # the whole config: [model], [cache] and [runtime]
    # Debug only, never a setting: False skips the fence wait, so that tests can show
    # that they detect a missing fence.
    wait_fences: ClassVar[bool] = True

    def on_start(self) -> None:
        config = self.ctx.config
        assert isinstance(config, Config)
        rank = self.ctx.rank
        self.model, self.info = load_model(config.model)
        c = self.model.config
        layout = KVLayout(
            num_blocks=config.cache.device_blocks,
            layers=c.layers,
            block_size=config.cache.block_size,
            kv_heads=c.kv_heads,
            head_dim=c.head_dim,
            dtype=config.model.dtype,
        )
        shm_name = posix_name(self.ctx.run_id, f"kv.device.{rank}") if self.ctx.run_id else ""
        self.space: SharedKV | None = create_kv(layout, config.model.device, shm_name=shm_name)
        if config.cache.poison_freed:  # nothing is valid yet: any read of it shows up as NaN
            self.space.poison(range(layout.num_blocks))
        self.executor: PagedExecutor | None = PagedExecutor(self.model, self.space.kv)
        self.cuda = self.space.kv.device.type == "cuda"
        lanes = self.ctx.counters.get(LANES)
        if lanes is None:
            raise RuntimeError(f"the topology has no {LANES!r} counter block for the watermarks")
        self.step_done = lane_counter(lanes, rank, Lane.STEP)
        self.swap_done = lane_counter(lanes, rank, Lane.SWAP)
        self.store_done = lane_counter(lanes, rank, Lane.STORE)
        # The Transfer actor waits on step_done (a swap-out reads what a step wrote: I2).
        wakers = [self.bell_of(f"transfer-{rank}")]
        self.step_done.claim(notify=[w for w in wakers if w is not None])
        self.last: StepResult | None = None  # kept to answer a repeat of the last plan
        self.steps = 0
        self.log.info(
            "worker.ready",
            model_id=self.info.model_id,
            device=self.space.handle.device,
            kv_shm=self.space.handle.shm,
            num_blocks=layout.num_blocks,
            block_bytes=layout.block_bytes,
            step_done=self.step_done.value(),
        )
        self.send(
            "engine",
            WorkerReady(
                rank=rank,
                epoch=self.ctx.epoch,
                incarnation=self.ctx.incarnation,
                step_done=self.step_done.value(),
                model=self.info,
                kv=self.space.handle,
            ),
        )

    def on_stop(self) -> None:
        self.executor = None
        if self.space is not None:
            self.space.close()
            self.space = None

    @property
    def kv(self) -> torch.Tensor:
        assert self.space is not None
        return self.space.kv

    @handles(StepPlan)
    def on_plan(self, plan: StepPlan) -> None:
        done = self.step_done.value()
        if plan.step <= done:
            self._repeat(plan)
            return
        if plan.step != done + 1:
            # A hole in the lane: running it would claim the missing steps were done.
            self._reply(plan, "rejected", f"step {plan.step} arrived when {done + 1} is next")
            return
        pieces = [_piece(p) for p in plan.pieces]
        problem = self._problem(plan, pieces)
        if problem:
            self._finish(plan, "rejected", error=problem)
            return
        if plan.epoch < self.ctx.epoch:
            self._finish(plan, "cancelled", error=_stale(plan.epoch, self.ctx.epoch))
            return
        started = time.perf_counter_ns()
        try:
            if self.wait_fences:
                seen_swap, seen_store = self._wait_fence(plan)
            else:
                seen_swap, seen_store = self.swap_done.value(), self.store_done.value()
        except _Cancelled as e:
            self._finish(plan, "cancelled", error=e.reason)
            return
        waited = time.perf_counter_ns()
        outputs = self._execute(plan, pieces)
        self._finish(
            plan,
            "ok",
            outputs=outputs,
            wait_ns=waited - started,
            exec_ns=time.perf_counter_ns() - waited,
            seen_swap=seen_swap,
            seen_store=seen_store,
        )

    def _problem(self, plan: StepPlan, pieces: list[Piece]) -> str:
        """Why the plan must not run, or ""."""
        assert self.executor is not None
        if plan.fence.step:
            return f"the fence of a step plan names the step lane ({plan.fence.step})"
        num_blocks = self.executor.num_blocks
        bad = [b for b in plan.poison if not 0 <= b < num_blocks]
        if bad:
            return f"poison block id {bad[0]} is outside the pool's {num_blocks} blocks"
        for i, p in enumerate(plan.pieces):
            if p.temperature < 0:
                return f"piece {i} has a negative temperature {p.temperature}"
        if pieces:
            try:
                self.executor.check(pieces)
            except ValueError as e:
                return str(e)
        return ""

    def _wait_fence(self, plan: StepPlan) -> tuple[int, int]:
        """Sleep until swap_done and store_done reach the fence; the values seen."""
        seen = []
        for lane, mark, target in (
            (Lane.SWAP, self.swap_done, plan.fence.swap),
            (Lane.STORE, self.store_done, plan.fence.store),
        ):

            def reached(mark: Watermark = mark, target: int = target) -> bool:
                return mark.value() >= target

            if not reached() and not self.wait_until(reached):
                epoch = self.current_epoch()
                if plan.epoch < epoch:
                    raise _Cancelled(_stale(plan.epoch, epoch))
                raise mark.overdue(target, f"for step {plan.step} ({lane} lane)")
            seen.append(mark.value())
        return seen[0], seen[1]

    def _execute(self, plan: StepPlan, pieces: list[Piece]) -> tuple[SampledToken, ...]:
        assert self.space is not None and self.executor is not None
        self.space.poison(plan.poison)
        if not pieces:
            if self.cuda:  # step_done covers the writes: done, not merely queued
                torch.cuda.current_stream(self.kv.device).synchronize()
            return ()
        # One copy for all pieces; on CUDA it waits for the step, KV writes included.
        logits = self.executor.step(pieces).last_logits.to("cpu")
        outputs = []
        for row, (p, piece) in enumerate(zip(plan.pieces, pieces, strict=True)):
            if not p.sample:
                continue
            position = piece.start + len(piece.token_ids)
            token = sample(logits[row], temperature=p.temperature, seed=p.seed, position=position)
            outputs.append(
                SampledToken(
                    seq_id=p.seq_id,
                    position=position,
                    token_id=token.token_id,
                    logprob=token.logprob,
                )
            )
        return tuple(outputs)

    def _finish(
        self,
        plan: StepPlan,
        status: StepStatus,
        *,
        outputs: tuple[SampledToken, ...] = (),
        error: str = "",
        wait_ns: int = 0,
        exec_ns: int = 0,
        seen_swap: int | None = None,
        seen_store: int | None = None,
    ) -> None:
        """Advance step_done past the plan, then report it."""
        self.step_done.advance(plan.step)
        self.steps += 1
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
            error=error or None,
        )
        self.last = StepResult(
            step=plan.step,
            epoch=plan.epoch,
            status=status,
            outputs=outputs,
            error=error,
            wait_ns=wait_ns,
            exec_ns=exec_ns,
        )
        self.send("engine", self.last)

    def _reply(self, plan: StepPlan, status: StepStatus, error: str) -> None:
        """Answer a plan without running it or moving the watermark."""
        self.log.error("step.refused", step=plan.step, plan_epoch=plan.epoch, error=error)
        self.send(
            "engine", StepResult(step=plan.step, epoch=plan.epoch, status=status, error=error)
        )

    def _repeat(self, plan: StepPlan) -> None:
        last = self.last
        resent = last is not None and last.step == plan.step
        self.log.warning("step.repeat", step=plan.step, plan_epoch=plan.epoch, resent=resent)
        if resent:
            assert last is not None
            self.send("engine", last)


def _piece(p: PlanPiece) -> Piece:
    return Piece(token_ids=p.token_ids, start=p.start, block_table=p.block_table)


def _stale(plan_epoch: int, epoch: int) -> str:
    return f"plan of epoch {plan_epoch} is older than the run's epoch {epoch}"

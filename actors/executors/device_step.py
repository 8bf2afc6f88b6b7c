"""A step's work on the device, as the Worker runs it on rank 0: launched, then landed.

:meth:`DeviceStep.launch` queues the step's kernels: the plan's poison, its forward and its
draw (on the CPU they run there and then). :meth:`DeviceStep.land` waits for them: the
prompt log probabilities, then the tokens, collected once the device has finished, with the
next plan checked ahead in between (``look_ahead.py``), so that ``step_done`` covers the
step's writes when the Worker reports it. The Worker may launch the next step before this
one is reported (``model.launch_ahead``, ``worker.py``): its kernels queue behind this
step's. Launched in :meth:`DeviceStep.land`, once the look-ahead has checked it and before
this step's tokens are read back, it takes its inputs from this step's draw on the device
(``pending.py``), and the device goes from one step to the next without waiting for the
host; launched after, from the tokens on the host. Landing a step waits for its own work
alone (an event recorded after it), never for a step queued behind it.

:meth:`DeviceStep.open` makes the rank's device tier, its executor (the CUDA graphs
captured) and its sampler. Ranks above 0 and plans without pieces run in one call
(:meth:`DeviceStep.execute`): the forward without logits, or nothing, then a wait for the
device.

Owned by the Worker's actor thread; not thread-safe.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from ringfence.actors.executors.constraints import MaskJob
from ringfence.actors.executors.look_ahead import CheckAhead, DeviceWatch
from ringfence.actors.executors.sampling import Draw, Sampler
from ringfence.actors.executors.timing import StepTimer
from ringfence.actors.executors.touches import Touches
from ringfence.actors.kv.layout import kv_layout
from ringfence.actors.kv.space import SharedKV, create_kv
from ringfence.actors.model.inputs import DeviceInputs
from ringfence.actors.model.paged import PagedExecutor, StepOutput
from ringfence.actors.model.parallel import rank_device
from ringfence.actors.protocol.worker import PromptLogprobs, Sampled
from ringfence.actors.text.grammars import model_grammars
from ringfence.cache.fences import Lane, Tier
from ringfence.sched.ops import StepOp
from ringfence.shm.names import posix_name

if TYPE_CHECKING:
    from ringfence.actors.executors.config import LaneSettings
    from ringfence.actors.model.decoder import Model
    from ringfence.runtime.log import ActorLog

NOTHING_SAMPLED = Sampled()


class Launched(NamedTuple):
    """A step whose kernels (its forward and its draw) are queued and whose tokens are not
    collected yet; or the error its launch raised. Launched ahead (``model.launch_ahead``),
    it also holds what its turn would have read: the watermarks seen and its clocks."""

    plan: StepOp  # its pending inputs resolved, or on the device (``behind``)
    out: StepOutput | None = None
    draw: Draw | None = None
    masks: MaskJob | None = None
    error: Exception | None = None
    done: torch.cuda.Event | None = None  # on CUDA: recorded after its kernels and its draw
    seen: dict[Lane, int] | None = None
    started: int = 0
    waited: int = 0
    # Launched before the step before it was landed (that step's number; 0: after): it ran
    # on what that step computed, its tokens included, so it fails if that step does.
    behind: int = 0
    marks: list[torch.cuda.Event | int] | None = None  # its StepTimer marks, taken so far
    touches: Touches | None = None  # its record of the blocks it touched (trace level)


# Called by :meth:`DeviceStep.land` once the next plan is checked ahead and before the
# landing step's tokens are read: it may launch that plan, on this draw's tokens.
LaunchNext = Callable[[Draw | None], None]


class DeviceStep:
    """The device side of one rank's steps: its KV space, its executor over it and its
    sampler, made by :meth:`open` and released by :meth:`close`. The Worker gives it the
    look-ahead (``ahead``, ``watch``) once it has made one over the executor's check."""

    def __init__(self, space: SharedKV, executor: PagedExecutor, sampler: Sampler) -> None:
        self.space, self.executor, self.sampler = space, executor, sampler
        self.ahead: CheckAhead | None = None
        self.watch: DeviceWatch | None = None
        self.device = space.kv.device
        self.cuda = self.device.type == "cuda"
        self.timer = StepTimer(self.device)
        self.rank = executor.model.shard.rank

    @classmethod
    def open(cls, config: LaneSettings, model: Model, run_id: str, log: ActorLog) -> DeviceStep:
        """Rank ``model.shard.rank``'s device tier, new (a restart forgets every block and
        every sequence: the engine opens them again), its CUDA graphs captured so that no
        step waits for one (graphs.py), and the sampler (rank 0 alone compiles grammars)."""
        rank = model.shard.rank
        layout = kv_layout(config, Tier.DEVICE, model.config)
        shm_name = posix_name(run_id, f"kv.device.{rank}") if run_id else ""
        device = rank_device(config.model.device, rank)
        space = create_kv(layout, device, shm_name=shm_name)
        if config.cache.poison_freed:  # nothing is valid yet: any read of it shows up as NaN
            space.poison(range(layout.num_blocks))
        executor = PagedExecutor(
            model,
            space.kv,
            attention=config.model.attention,
            cuda_graphs=config.model.cuda_graphs,
            attention_splits=config.model.attention_splits,
        )
        executor.record_touches = log.tracing  # for op.touched (touches.py)
        if executor.graphs is not None:
            began = time.perf_counter()
            captured = executor.graphs.capture_all()
            took = round(time.perf_counter() - began, 3)
            buckets = [v.bucket for v in captured if v.splits == 1]
            splits = {str(v.bucket): v.splits for v in captured if v.splits > 1}
            log.info("worker.graphs", buckets=buckets, splits=splits, capture_s=took)
        vocab_size = model.config.vocab_size
        grammars = model_grammars(config.model.path, vocab_size) if rank == 0 else None
        sampler = Sampler(vocab_size, config.model.logprobs_mode, grammars, device=device)
        return cls(space, executor, sampler)

    def close(self) -> None:
        """Stop the threads it runs (the device watch, the grammar masks') and drop the KV
        space. Idempotent."""
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self.sampler.constraints is not None:
            self.sampler.constraints.close()
        self.space.close()

    def problem(self, plan: StepOp) -> str:
        """Why this tier must not run the plan, or "" (changes nothing but the look-ahead's
        kept verdict, given once): a poison id outside the pool, a piece the sampler cannot
        sample, a table or token the step check refuses (checked ahead, or now)."""
        num_blocks = self.executor.num_blocks
        bad = [b for b in plan.poison if not 0 <= b < num_blocks]
        if bad:
            return f"poison block id {bad[0]} is outside the pool's {num_blocks} blocks"
        if problem := self.sampler.problem(plan.pieces):
            return problem
        if plan.pieces:
            if self.ahead is not None and (verdict := self.ahead.verdict(plan)) is not None:
                return verdict  # checked while the step before it ran (look_ahead.py)
            try:
                self.executor.check(plan.pieces)
            except ValueError as e:
                return str(e)
        return ""

    def execute(
        self, plan: StepOp, touches: Touches | None, launch_next: LaunchNext | None = None
    ) -> tuple[Sampled, tuple[PromptLogprobs, ...]]:
        """Run the plan: the sampled tokens (rank 0) and the prompt log probabilities asked
        (``launch_next``: as :meth:`land` takes it)."""
        if not plan.pieces or self.rank > 0:
            self._poison_and_advance(plan, touches)
            if plan.pieces:  # rank 0 samples; the others write KV and join the all-reduces
                self.executor.step_without_logits(plan.pieces, checked=True)  # see launch
                self._look_ahead()
                self.touched(touches)
            self._synchronize()
            return NOTHING_SAMPLED, ()
        return self.land(self.launch(plan, touches), launch_next)

    def launch(
        self, plan: StepOp, touches: Touches | None, inputs: DeviceInputs | None = None
    ) -> Launched:
        """Queue a step's kernels (rank 0, a plan with pieces): the poison, its forward and
        its draw. On the CPU they run here. ``inputs``: its pending decodes' tokens, on the
        device (``pending.on_device``)."""
        self._poison_and_advance(plan, touches, inputs)
        masks = self.sampler.start_masks(plan.pieces)  # filled beside the forward
        try:
            self.timer.mark()
            # Checked once, before it ran (Worker._problem): its pending inputs are tokens
            # this model sampled, which lie in its vocabulary.
            out = self.executor.step(
                plan.pieces, whole=self.sampler.whole(plan.pieces), checked=True, inputs=inputs
            )
            self.timer.mark()
            self.touched(touches)
            # Sampled where the logits are; only the tokens and logprobs come back.
            draw = self.sampler.queue(plan.pieces, out.last_logits, masks)
        except BaseException:
            if masks is not None:  # the fill reads the matchers: done before a plan moves them
                masks.wait()
            raise
        return Launched(plan, out, draw, masks, done=self._record())

    def land(
        self, launched: Launched, launch_next: LaunchNext | None = None
    ) -> tuple[Sampled, tuple[PromptLogprobs, ...]]:
        """A launched step's prompt log probabilities and tokens, once its device work is
        done (step_done covers its writes: done, not merely queued). ``launch_next`` is
        called after the look-ahead, before the tokens are read (:data:`LaunchNext`)."""
        plan, out, masks = launched.plan, launched.out, launched.masks
        assert out is not None
        try:
            prompt = self.sampler.prompt_logprobs(plan.pieces, out.piece_logits or {})
            sampled = self._collect(launched.draw, launch_next)
            if launched.done is not None:  # its own kernels, not those queued behind it
                launched.done.synchronize()
            return sampled, prompt
        finally:
            if masks is not None:  # the fill reads the matchers: done before a plan moves them
                masks.wait()

    def wait(self, launched: Launched) -> None:
        """Wait until a launched step's device work is done, reading none of it (a step that
        fails at its turn: its writes are spoiled after, not under, its kernels)."""
        try:
            if launched.done is not None:
                launched.done.synchronize()
        finally:
            if launched.masks is not None:
                launched.masks.wait()

    def touched(self, touches: Touches | None) -> None:
        """Add the blocks the model's step indexed to the op's touches (when tracing)."""
        touched, self.executor.touched = self.executor.touched, None
        if touches is not None and touched is not None:
            touches.read("device", touched.reads)
            touches.write("device", touched.writes)

    def _poison_and_advance(
        self, plan: StepOp, touches: Touches | None, inputs: DeviceInputs | None = None
    ) -> None:
        self.space.poison(plan.poison)
        if touches is not None:
            touches.write("device", plan.poison)
        self.sampler.advance(plan.pieces, inputs)

    def _collect(self, draw: Draw | None, launch_next: LaunchNext | None = None) -> Sampled:
        """The tokens of the step's draw (the timer's last mark taken at its end), with the
        next plan checked ahead (on CUDA while the device computes them) and, given
        ``launch_next``, perhaps launched on this draw before its tokens are read."""
        if not self.cuda and launch_next is None:
            sampled = self.sampler.collect(draw)
            self.timer.mark()
            self._look_ahead()
            return sampled
        self.timer.mark()  # an event: the draw's end on the device
        self._look_ahead()
        if launch_next is not None:
            launch_next(draw)
        return self.sampler.collect(draw)

    def _record(self) -> torch.cuda.Event | None:
        """An event after the work queued so far (None on the CPU, where it has run)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _look_ahead(self) -> None:
        """Check the next plan, if it comes before the device is done (look_ahead.py)."""
        if self.ahead is not None:
            done = self.watch.queued(self.device) if self.watch is not None else None
            self.ahead.check_next(done)  # no wait elsewhere: the step is done already

    def _synchronize(self) -> None:
        if self.cuda:  # step_done covers the writes: done, not merely queued
            torch.cuda.current_stream(self.device).synchronize()


def written_blocks(plan: StepOp, block_size: int) -> list[int]:
    """The device blocks a plan's pieces write: those holding positions start ..
    start + len - 1 of each (the blocks before them are only read)."""
    written: set[int] = set()
    for p in plan.pieces:
        if p.token_ids:
            first, last = p.start // block_size, (p.start + len(p.token_ids) - 1) // block_size
            written.update(p.block_table[first : last + 1])
    return sorted(written)

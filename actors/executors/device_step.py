"""A step's work on the device, as the Worker runs it on rank 0: launched, then landed.

:meth:`DeviceStep.launch` queues the step's kernels: the plan's poison, its forward and its
draw (on the CPU they run there and then). :meth:`DeviceStep.land` waits for them: the
prompt log probabilities, then the tokens, collected once the device has finished, with the
next plan checked ahead in between (``look_ahead.py``), so that ``step_done`` covers the
step's writes when the Worker reports it. Between the two the Worker may launch the next
step (``model.launch_ahead``, ``worker.py``): its kernels queue behind this step's, and its
inputs are this step's tokens, on the host by then.

:meth:`DeviceStep.open` makes the rank's device tier, its executor (the CUDA graphs
captured) and its sampler. Ranks above 0 and plans without pieces run in one call
(:meth:`DeviceStep.execute`): the forward without logits, or nothing, then a wait for the
device.

Owned by the Worker's actor thread; not thread-safe.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import torch

from ringfence.actors.executors.constraints import MaskJob
from ringfence.actors.executors.look_ahead import CheckAhead, DeviceWatch
from ringfence.actors.executors.sampling import Draw, Sampler
from ringfence.actors.executors.timing import StepTimer
from ringfence.actors.executors.touches import Touches
from ringfence.actors.kv.layout import kv_layout
from ringfence.actors.kv.space import SharedKV, create_kv
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

    plan: StepOp  # its pending inputs resolved
    out: StepOutput | None = None
    draw: Draw | None = None
    masks: MaskJob | None = None
    error: Exception | None = None
    seen: dict[Lane, int] | None = None
    started: int = 0
    waited: int = 0


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
            model, space.kv, attention=config.model.attention, cuda_graphs=config.model.cuda_graphs
        )
        executor.record_touches = log.tracing  # for op.touched (touches.py)
        if executor.graphs is not None:
            began = time.perf_counter()
            captured = executor.graphs.capture_all()
            took = round(time.perf_counter() - began, 3)
            log.info("worker.graphs", buckets=captured, capture_s=took)
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

    def execute(
        self, plan: StepOp, touches: Touches | None
    ) -> tuple[Sampled, tuple[PromptLogprobs, ...]]:
        """Run the plan: the sampled tokens (rank 0) and the prompt log probabilities asked."""
        if not plan.pieces or self.rank > 0:
            self._poison_and_advance(plan, touches)
            if plan.pieces:  # rank 0 samples; the others write KV and join the all-reduces
                self.executor.step_without_logits(plan.pieces, checked=True)  # see launch
                self._look_ahead()
                self.touched(touches)
            self._synchronize()
            return NOTHING_SAMPLED, ()
        return self.land(self.launch(plan, touches))

    def launch(self, plan: StepOp, touches: Touches | None) -> Launched:
        """Queue a step's kernels (rank 0, a plan with pieces): the poison, its forward and
        its draw. On the CPU they run here."""
        self._poison_and_advance(plan, touches)
        masks = self.sampler.start_masks(plan.pieces)  # filled beside the forward
        try:
            self.timer.mark()
            # Checked once, before it ran (Worker._problem): resolving its pending inputs put
            # in only tokens this model sampled, which lie in its vocabulary.
            out = self.executor.step(
                plan.pieces, whole=self.sampler.whole(plan.pieces), checked=True
            )
            self.timer.mark()
            self.touched(touches)
            # Sampled where the logits are; only the tokens and logprobs come back.
            draw = self.sampler.queue(plan.pieces, out.last_logits, masks)
        except BaseException:
            if masks is not None:  # the fill reads the matchers: done before a plan moves them
                masks.wait()
            raise
        return Launched(plan, out, draw, masks)

    def land(self, launched: Launched) -> tuple[Sampled, tuple[PromptLogprobs, ...]]:
        """A launched step's prompt log probabilities and tokens, once its device work is
        done (step_done covers its writes: done, not merely queued)."""
        plan, out, masks = launched.plan, launched.out, launched.masks
        assert out is not None
        try:
            prompt = self.sampler.prompt_logprobs(plan.pieces, out.piece_logits or {})
            sampled = self._collect(launched.draw)
            self._synchronize()  # nothing is queued after it: the next launches after this
            return sampled, prompt
        finally:
            if masks is not None:  # the fill reads the matchers: done before a plan moves them
                masks.wait()

    def touched(self, touches: Touches | None) -> None:
        """Add the blocks the model's step indexed to the op's touches (when tracing)."""
        touched, self.executor.touched = self.executor.touched, None
        if touches is not None and touched is not None:
            touches.read("device", touched.reads)
            touches.write("device", touched.writes)

    def _poison_and_advance(self, plan: StepOp, touches: Touches | None) -> None:
        self.space.poison(plan.poison)
        if touches is not None:
            touches.write("device", plan.poison)
        self.sampler.advance(plan.pieces)

    def _collect(self, draw: Draw | None) -> Sampled:
        """The tokens of the step's draw (the timer's last mark taken at its end), with the
        next plan checked ahead: on CUDA while the device computes them."""
        if not self.cuda:
            sampled = self.sampler.collect(draw)
            self.timer.mark()
            self._look_ahead()
            return sampled
        self.timer.mark()  # an event: the draw's end on the device
        self._look_ahead()
        return self.sampler.collect(draw)

    def _look_ahead(self) -> None:
        """Check the next plan, if it comes before the device is done (look_ahead.py)."""
        if self.ahead is not None:
            done = self.watch.queued(self.device) if self.watch is not None else None
            self.ahead.check_next(done)  # no wait elsewhere: the step is done already

    def _synchronize(self) -> None:
        if self.cuda:  # step_done covers the writes: done, not merely queued
            torch.cuda.current_stream(self.device).synchronize()

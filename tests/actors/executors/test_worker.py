"""The Worker actor: step plans in, fenced, run on the paged KV tensor, results out.

The worker runs in a thread of the test process on a real driver, with shared-memory
watermarks; the test plays the Engine (posting plans, reading results) and the
Transfer actor's swap lane (writing blocks, then advancing ``swap_done``, ringing the
worker like the real writer does). Every output is compared with a contiguous forward
of the same model over the whole sequence, in float64.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from builders import opened
from lane_rig import WAIT_S, Executor, start_executor

from ringfence.actors.config import Config
from ringfence.actors.executors.ranks import GroupFailed
from ringfence.actors.executors.worker import Worker
from ringfence.actors.kv.space import open_kv
from ringfence.actors.model.decoder import Model
from ringfence.actors.protocol.lanes import ISSUER_EPOCH, TIER_EPOCH, epoch_counter, lane_counter
from ringfence.actors.protocol.worker import FROM_WORKER, TO_WORKER, StepResult, WorkerReady
from ringfence.cache.fences import Fence, Lane
from ringfence.cache.ids import Seq as SeqNo
from ringfence.runtime.driver import Driver
from ringfence.runtime.mailbox import Delivery, LocalInbox, Mailbox
from ringfence.sched.ops import Piece, StepOp
from ringfence.shm import names
from ringfence.shm.counter import CounterBlock, Watermark

BLOCK = 4  # tokens per block: small, so sequences span many blocks
POOL = 40  # device blocks
SETTINGS = (
    "model.preset=tiny",
    "model.dtype=float64",
    f"cache.block_size={BLOCK}",
    f"cache.device_blocks={POOL}",
    "runtime.heartbeat_s=0.05",
    "runtime.heartbeat_timeout_s=0.6",  # a fence wait gives up (and is retried) after 0.3 s
)


@dataclass
class Rig:
    """A running worker-0 and the test's ends of its protocol."""

    driver: Driver
    plans: LocalInbox  # engine -> worker
    results: LocalInbox  # worker -> engine
    results_box: Mailbox
    lanes: CounterBlock
    control: CounterBlock
    log_path: Path
    seen: list[object] = field(default_factory=list)

    @property
    def worker(self) -> Worker:
        actor = self.driver.actor
        assert isinstance(actor, Worker)
        return actor

    @property
    def kv(self) -> torch.Tensor:
        return self.worker.kv

    def mark(self, lane: Lane) -> Watermark:
        return lane_counter(self.lanes, 0, lane)

    def post(self, plan: StepOp) -> None:
        self.plans.post(plan)

    def next_message(self) -> object:
        """The next message from the worker, waiting up to WAIT_S."""
        assert self.results_box.waiter.wait_until(self.results.pending, WAIT_S), "no reply"
        delivery = self.results.read()
        assert delivery is not None
        self.seen.append(delivery.msg)
        return delivery.msg

    def result(self, step: int) -> StepResult:
        msg = self.next_message()
        assert isinstance(msg, StepResult), msg
        assert msg.step == step, msg
        return msg

    def events(self, name: str) -> list[dict[str, Any]]:
        self.driver.log.flush()
        lines = [orjson.loads(line) for line in self.log_path.read_bytes().splitlines()]
        return [line for line in lines if line["event"] == name]

    def swap_in(self, to: int, write: Callable[[], None] = lambda: None) -> None:
        """Play the swap lane: do its copy, then publish swap_done = ``to``."""
        write()
        self.mark(Lane.SWAP).advance(to)


@pytest.fixture
def make_rig(tmp_path: Path, run_id: str) -> Iterator[Callable[..., Rig]]:
    started: list[Executor] = []

    def make(*overrides: str, epoch: int = 0) -> Rig:
        config: Config = Config.load(None, [*SETTINGS, *overrides])
        ex = start_executor(
            Worker, "worker", config=config, run_id=run_id, log_dir=tmp_path,
            inbox=TO_WORKER, replies=FROM_WORKER, epoch=epoch,
        )  # fmt: skip
        started.append(ex)
        rig = Rig(
            ex.driver, ex.inbox, ex.replies, ex.replies_box, ex.lanes, ex.control, ex.log_path
        )
        # The test writes the swap and store lanes; it rings the worker as Transfer would.
        rig.mark(Lane.SWAP).claim(notify=[ex.waiter])
        rig.mark(Lane.STORE).claim(notify=[ex.waiter])
        ready = rig.next_message()
        assert isinstance(ready, WorkerReady)
        return rig

    yield make
    for ex in started:
        ex.stop()
    names.clean_run(run_id)


@pytest.fixture(scope="module")
def reference() -> Model:
    return Model.from_preset("tiny", torch.float64, seed=0).eval()


@dataclass
class Seq:
    """One sequence of a scripted program: its prompt, blocks, and what the worker returned."""

    seq_id: int
    prompt: list[int]
    blocks: list[int]
    done: int = 0  # tokens already in the KV blocks
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated


def next_piece(seq: Seq, rng: random.Random) -> Piece:
    """The sequence's next prefill chunk (random length) or its next decode token."""
    if seq.done < len(seq.prompt):
        size = rng.randint(1, len(seq.prompt) - seq.done)
        ids = seq.prompt[seq.done : seq.done + size]
        last = seq.done + size == len(seq.prompt)
    else:
        ids, last = [seq.generated[-1]], True
    return Piece(
        seq_id=seq.seq_id,
        token_ids=tuple(ids),
        start=seq.done,
        block_table=tuple(seq.blocks),
        sample=last,
        opening=opened(len(seq.prompt)) if seq.done == 0 else None,
    )


def run_program(rig: Rig, seqs: list[Seq], rng: random.Random, decode: int, step: int = 1) -> int:
    """Steps of mixed pieces until every sequence decoded ``decode`` tokens; the next step."""
    while any(len(s.generated) < decode for s in seqs):
        active = [s for s in seqs if len(s.generated) < decode]
        pieces = tuple(next_piece(s, rng) for s in active)
        rig.post(StepOp(step=step, epoch=0, fence=Fence(), pieces=pieces))
        result = rig.result(step)
        assert result.status == "ok", result.error
        by_id = {out.seq_id: out for out in result.sampled.tokens()}
        for seq, piece in zip(active, pieces, strict=True):
            seq.done = piece.start + len(piece.token_ids)
            if piece.sample:
                out = by_id.pop(seq.seq_id)
                assert out.position == seq.done
                seq.generated.append(out.token_id)
                seq.logprobs.append(out.logprob)
        assert not by_id, "an output for a piece that did not ask for one"
        step += 1
    return step


def check_against_reference(model: Model, seq: Seq) -> None:
    """Every generated token is the greedy pick of a contiguous forward, logprob within 1e-9."""
    logits = model.forward_contiguous(torch.tensor(seq.tokens))
    logprobs = torch.log_softmax(logits, dim=-1)
    for k, (token, logprob) in enumerate(zip(seq.generated, seq.logprobs, strict=True)):
        row = len(seq.prompt) + k - 1  # the logits that predicted generated token k
        assert token == int(torch.argmax(logits[row])), f"seq {seq.seq_id} token {k}"
        assert abs(logprob - float(logprobs[row, token])) < 1e-9


def make_seqs(rng: random.Random, count: int, free: list[int], decode: int) -> list[Seq]:
    seqs = []
    for i in range(count):
        prompt = [rng.randrange(256) for _ in range(rng.randint(3, 22))]
        need = -(-(len(prompt) + decode) // BLOCK)
        seqs.append(Seq(seq_id=100 + i, prompt=prompt, blocks=[free.pop() for _ in range(need)]))
    return seqs


def test_the_worker_announces_its_model_and_a_kv_tensor_a_peer_can_open(make_rig) -> None:
    rig = make_rig()
    ready = next(m for m in rig.seen if isinstance(m, WorkerReady))
    assert ready.model.model_id == "preset-tiny-seed0"
    assert (ready.model.vocab_size, ready.model.dtype) == (259, "float64")
    assert ready.kv.shm == names.posix_name(rig.driver.ctx.run_id, "kv.device.0")
    assert ready.kv.layout.shape == tuple(rig.kv.shape) and ready.kv.layout.num_blocks == POOL
    peer = open_kv(ready.kv)
    try:
        peer.kv[7].fill_(0.25)  # what the Transfer actor writes, the worker reads
        assert bool((rig.kv[7] == 0.25).all())
    finally:
        peer.close()


def test_mixed_steps_of_random_chunks_give_the_tokens_of_a_contiguous_forward(
    make_rig, reference: Model, rng: random.Random
) -> None:
    rig = make_rig()
    free = list(range(POOL))
    rng.shuffle(free)
    seqs = make_seqs(rng, 4, free, decode=5)
    run_program(rig, seqs, rng, decode=5)
    for seq in seqs:
        check_against_reference(reference, seq)
    assert rig.mark(Lane.STEP).value() == len(rig.events("step.done"))


@pytest.mark.parametrize("fenced", [True, False], ids=["fenced", "unfenced"])
def test_a_step_reads_swapped_in_blocks_only_after_the_swap_watermark_reaches_its_fence(
    make_rig, reference: Model, rng: random.Random, fenced: bool
) -> None:
    """I1: a step does not read a device block before the swap-in that fills it is done.

    The sequence's blocks are poisoned (NaN) by a step, as after a swap-out; the decode
    step that reads them is posted with fence swap=1 while a delayed "swap-in" restores
    them and only then advances swap_done. Without the wait (``transfer.skip_fences``,
    debug only) the step reads NaN.
    """
    rig = make_rig(f"transfer.skip_fences={str(not fenced).lower()}")
    free = list(range(POOL))
    rng.shuffle(free)
    [seq] = make_seqs(rng, 1, free, decode=2)
    step = run_program(rig, [seq], rng, decode=1)
    saved = rig.kv[list(seq.blocks)].clone()
    rig.post(StepOp(step=step, epoch=0, fence=Fence(), pieces=(), poison=tuple(seq.blocks)))
    assert rig.result(step).status == "ok"
    assert bool(torch.isnan(rig.kv[list(seq.blocks)]).all())

    def restore() -> None:
        rig.kv[list(seq.blocks)] = saved

    swapper = threading.Timer(0.2, rig.swap_in, args=(1, restore))
    swapper.start()
    try:
        piece = next_piece(seq, rng)
        rig.post(StepOp(step=step + 1, epoch=0, fence=Fence(swap=SeqNo(1)), pieces=(piece,)))
        result = rig.result(step + 1)
    finally:
        swapper.join(WAIT_S)
    if fenced:
        [out] = result.sampled.tokens()
        seq.generated.append(out.token_id)
        seq.logprobs.append(out.logprob)
        check_against_reference(reference, seq)
        [line] = [e for e in rig.events("step.done") if e["step"] == step + 1]
        assert line["fence_swap"] == 1 and line["seen_swap"] >= 1
    else:  # it read the NaN blocks: the step failed, naming why, and the lane went on
        assert result.status == "failed" and "not finite" in result.error, result
        assert rig.mark(Lane.STEP).value() == step + 1


def test_a_fence_wait_past_its_deadline_defers_the_plan_and_runs_it_when_the_swap_is_done(
    make_rig, reference: Model, rng: random.Random
) -> None:
    rig = make_rig()
    free = list(range(POOL))
    rng.shuffle(free)
    [seq] = make_seqs(rng, 1, free, decode=2)
    step = run_program(rig, [seq], rng, decode=1)
    # The swap lane is slower than the worker's wait slice (0.3 s): deferred, then run.
    swapper = threading.Timer(1.0, rig.swap_in, args=(3,))
    swapper.start()
    try:
        piece = next_piece(seq, rng)
        rig.post(StepOp(step=step, epoch=0, fence=Fence(swap=SeqNo(3)), pieces=(piece,)))
        result = rig.result(step)
    finally:
        swapper.join(WAIT_S)
    assert result.status == "ok" and result.wait_ns > 0
    seq.generated.append(result.sampled.token_ids[0])
    seq.logprobs.append(result.sampled.logprobs[0])
    check_against_reference(reference, seq)
    deferred = rig.events("msg.deferred")
    assert deferred and all(e["error"] == "WaitTimeout" for e in deferred)


def test_a_plan_whose_fence_is_not_reached_is_cancelled_once_its_engine_has_restarted(
    make_rig, rng: random.Random
) -> None:
    rig = make_rig()
    piece = Piece(seq_id=1, token_ids=(1, 2, 3), start=0, block_table=(0,), sample=True,
                  opening=opened())  # fmt: skip
    epoch = epoch_counter(rig.lanes, 0, ISSUER_EPOCH)
    epoch.claim()
    bump = threading.Timer(0.1, epoch.advance, args=(1,))  # an engine of epoch 1 started
    bump.start()
    try:
        rig.post(StepOp(step=1, epoch=0, fence=Fence(swap=SeqNo(5)), pieces=(piece,)))
        result = rig.result(1)
    finally:
        bump.join(WAIT_S)
    assert result.status == "cancelled" and "epoch 0" in result.error
    assert len(result.sampled) == 0 and rig.mark(Lane.STEP).value() == 1
    # The lane goes on with the next step.
    rig.post(StepOp(step=2, epoch=1, fence=Fence(), pieces=(piece,)))
    assert rig.result(2).status == "ok"


def test_a_plan_from_before_the_worker_started_is_cancelled_without_waiting(make_rig) -> None:
    rig = make_rig(epoch=2)  # this worker started in epoch 2
    assert epoch_counter(rig.lanes, 0, TIER_EPOCH).value() == 2  # published for the lanes
    piece = Piece(seq_id=1, token_ids=(1,), start=0, block_table=(0,), sample=True,
                  opening=opened())  # fmt: skip
    rig.post(StepOp(step=1, epoch=1, fence=Fence(swap=SeqNo(99)), pieces=(piece,)))
    result = rig.result(1)
    assert result.status == "cancelled" and "epoch 1" in result.error
    assert "device tier reset at epoch 2" in result.error


def test_poisoned_blocks_are_nan_and_the_outputs_of_other_sequences_do_not_change(
    make_rig, reference: Model, rng: random.Random
) -> None:
    rig = make_rig("cache.poison_freed=true")
    assert bool(torch.isnan(rig.kv).all()), "poison_freed starts from an all-NaN pool"
    free = list(range(POOL))
    rng.shuffle(free)
    seqs = make_seqs(rng, 2, free, decode=3)
    step = run_program(rig, seqs, rng, decode=2)
    doomed, kept = seqs
    piece = next_piece(kept, rng)
    plan = StepOp(step=step, epoch=0, fence=Fence(), pieces=(piece,), poison=tuple(doomed.blocks))
    rig.post(plan)
    [out] = rig.result(step).sampled.tokens()
    kept.generated.append(out.token_id)
    kept.logprobs.append(out.logprob)
    check_against_reference(reference, kept)
    assert bool(torch.isnan(rig.kv[doomed.blocks]).all())


def bits(kv: torch.Tensor) -> torch.Tensor:
    return kv.view(torch.int64).clone()  # NaN-safe equality


def test_a_step_that_raises_fills_the_blocks_it_wrote_with_nan_and_no_other(
    make_rig, monkeypatch
) -> None:
    rig = make_rig()
    prefix = tuple(range(1, BLOCK + 1))  # block 0, computed by step 1 and only read by step 2
    first = Piece(seq_id=1, token_ids=prefix, start=0, block_table=(0,), sample=False)
    rig.post(StepOp(step=1, epoch=0, fence=Fence(), pieces=(first,)))
    assert rig.result(1).status == "ok"
    executor = rig.worker.executor
    assert executor is not None
    real = executor.step

    def broken(pieces, **options):  # it ran, wrote its KV, then raised (out of memory...)
        real(pieces, **options)
        raise RuntimeError("the step broke after writing")

    monkeypatch.setattr(executor, "step", broken)
    before = bits(rig.kv)
    tokens = tuple(range(20, 20 + BLOCK + 2))  # positions BLOCK .. 2 * BLOCK + 1: blocks 5, 6
    piece = Piece(
        seq_id=1, token_ids=tokens, start=BLOCK, block_table=(0, 5, 6), sample=True,
        opening=opened(),
    )  # fmt: skip
    rig.post(StepOp(step=2, epoch=0, fence=Fence(), pieces=(piece,)))
    result = rig.result(2)
    assert result.status == "failed" and "broke after writing" in result.error, result
    assert len(result.sampled) == 0
    assert bool(torch.isnan(rig.kv[[5, 6]]).all()), "a failed step left KV that reads valid"
    others = [b for b in range(POOL) if b not in (5, 6)]
    assert torch.equal(bits(rig.kv)[others], before[others])
    (failed,) = rig.events("step.failed")
    assert (failed["step"], failed["spoiled"]) == (2, 2)
    assert rig.mark(Lane.STEP).value() == 2


def sampled(**fields: Any) -> Piece:
    """A piece of sequence 1 that samples, opening it greedily."""
    return Piece(seq_id=1, sample=True, opening=opened(), **fields)


PIECE = Piece(
    seq_id=1, token_ids=(1, 2, 3), start=0, block_table=(0,), sample=True, opening=opened()
)


@pytest.mark.parametrize(
    ("plan", "message"),
    [
        (StepOp(step=1, epoch=0, fence=Fence(), pieces=(
            sampled(token_ids=(1, 2), start=0, block_table=(POOL,)),
        )), f"block id {POOL}"),
        (StepOp(step=1, epoch=0, fence=Fence(), pieces=(
            sampled(token_ids=(1,), start=0, block_table=tuple(range(POOL + 1))),
        )), f"more than the pool's {POOL}"),
        (StepOp(step=1, epoch=0, fence=Fence(), pieces=(
            sampled(token_ids=(1,), start=4096, block_table=(0,)),
        )), "past max_position"),
        (StepOp(step=1, epoch=0, fence=Fence(), pieces=(
            sampled(token_ids=(1, 2, 3, 4, 5), start=0, block_table=(0,)),
        )), "need 2"),
        (StepOp(step=1, epoch=0, fence=Fence(), pieces=(
            sampled(token_ids=(1, 999), start=0, block_table=(0,)),
        )), "token id 999"),
        (StepOp(step=1, epoch=0, fence=Fence(), pieces=(
            sampled(token_ids=(1,), start=0, block_table=(3, 3)),
        )), "names a block twice"),
        (StepOp(step=1, epoch=0, fence=Fence(step=SeqNo(1)), pieces=(PIECE,)), "own lane"),
        (StepOp(step=1, epoch=0, fence=Fence(), pieces=(PIECE,), poison=(-1,)), "poison block"),
        (StepOp(step=1, epoch=0, fence=Fence(), pieces=(
            Piece(seq_id=1, token_ids=(1,), start=0, block_table=(0,), sample=True),
        )), "sequence 1 was never opened"),
        (StepOp(step=1, epoch=0, fence=Fence(), pieces=(
            replace(PIECE, opening=opened(logit_bias={999: 1.0})),
        )), "logit_bias key 999 is outside the vocabulary"),
        (StepOp(step=1, epoch=0, fence=Fence(), pieces=(
            replace(PIECE, start=1, token_ids=(2, 3), opening=opened(presence_penalty=1.0)),
        )), "with 0 history tokens, but starts at 1"),
    ],
    ids=["unknown-block", "table-past-pool", "past-max-position", "short-table", "bad-token",
         "repeated-block", "own-lane-fence", "bad-poison", "never-opened", "bias-past-vocab",
         "short-history"],
)  # fmt: skip
def test_a_malformed_plan_is_rejected_naming_the_problem_and_touches_no_block(
    make_rig, plan: StepOp, message: str
) -> None:
    rig = make_rig()
    before = bits(rig.kv)
    rig.post(plan)
    result = rig.result(1)
    assert result.status == "rejected" and message in result.error, result.error
    assert torch.equal(bits(rig.kv), before)
    # Rejected is done (nothing to wait for): the lane moves on to step 2.
    assert rig.mark(Lane.STEP).value() == 1
    rig.post(StepOp(step=2, epoch=0, fence=Fence(), pieces=(PIECE,)))
    assert rig.result(2).status == "ok"


def test_a_plan_checked_while_the_step_before_it_ran_is_refused_in_the_same_words(
    make_rig,
) -> None:
    rig = make_rig("model.look_ahead=on")
    # Step 1 waits for the swap lane, so step 2 is queued behind it before it runs: the
    # Worker reads it ahead and checks it while step 1 runs (look_ahead.py).
    rig.post(StepOp(step=1, epoch=0, fence=Fence(swap=SeqNo(1)), pieces=(PIECE,)))
    bad = Piece(seq_id=1, token_ids=(999,), start=3, block_table=(0,), sample=True)
    rig.post(StepOp(step=2, epoch=0, fence=Fence(), pieces=(bad,)))
    rig.mark(Lane.SWAP).advance(1)
    assert rig.result(1).status == "ok"
    result = rig.result(2)
    assert result.status == "rejected", result
    assert result.error == "token id 999 of piece 0 is outside the vocabulary of 259"
    done = [(d["step"], d["status"], d["checked_ahead"]) for d in rig.events("step.done")]
    assert done == [(1, "ok", False), (2, "rejected", True)]
    rig.post(StepOp(step=3, epoch=0, fence=Fence(), pieces=(replace(bad, token_ids=(4,)),)))
    assert rig.result(3).status == "ok"  # and the lane goes on


def test_a_step_out_of_lane_order_is_refused_and_the_watermark_stays(make_rig) -> None:
    rig = make_rig()
    rig.post(StepOp(step=2, epoch=0, fence=Fence(), pieces=(PIECE,)))
    result = rig.result(2)
    assert result.status == "rejected" and "1 is next" in result.error
    assert rig.mark(Lane.STEP).value() == 0
    [line] = rig.events("step.refused")
    assert line["step"] == 2


def test_a_repeated_plan_is_answered_with_the_kept_result_and_not_run_again(make_rig) -> None:
    rig = make_rig()
    plan = StepOp(step=1, epoch=0, fence=Fence(), pieces=(PIECE,))
    rig.post(plan)
    first = rig.result(1)
    rig.post(plan)
    assert rig.result(1) == first
    assert rig.worker.steps == 1
    [line] = rig.events("step.repeat")
    assert line["resent"] is True


def test_sampled_tokens_are_reproducible_per_seed_and_position(make_rig) -> None:
    rig = make_rig()
    picks = []
    for step in (1, 2):  # the same prompt under 6 seeds, twice, in other blocks
        pieces = tuple(
            Piece(
                seq_id=seed, token_ids=(5, 6, 7), start=0, block_table=(6 * step + seed,),
                sample=True, opening=opened(temperature=1.5, seed=seed),
            )
            for seed in range(6)
        )  # fmt: skip
        rig.post(StepOp(step=step, epoch=0, fence=Fence(), pieces=pieces))
        picks.append(rig.result(step).sampled.tokens())
    assert picks[0] == picks[1]
    assert len({out.token_id for out in picks[0]}) > 1, "every seed drew the same token"


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the worker's CUDA path needs one"
)


@needs_cuda
def test_on_cuda_the_worker_shares_its_kv_by_ipc_and_gives_the_contiguous_forwards_tokens(
    make_rig, reference: Model, rng: random.Random
) -> None:
    rig = make_rig("model.device=cuda", "cache.poison_freed=true")
    ready = next(m for m in rig.seen if isinstance(m, WorkerReady))
    assert rig.kv.is_cuda and ready.kv.cuda_ipc and ready.kv.shm == ""
    free = list(range(POOL))
    rng.shuffle(free)
    seqs = make_seqs(rng, 3, free, decode=4)
    run_program(rig, seqs, rng, decode=4)
    for seq in seqs:
        check_against_reference(reference, seq)


def test_a_rank_whose_step_failed_in_its_collectives_dies_and_leaves_its_plan_on_its_ring():
    # Answered or committed, the plan would be lost to the group's next generation, whose
    # step_done would never pass it: a swap fenced on that step waited forever (a tp-2 run
    # whose Worker rank was killed hung so, once). Re-raised from on_failure, the driver
    # ends the actor before it commits the frame (tests/runtime/test_actor.py: a frame
    # whose handler crashed comes again after a restart).
    worker = Worker.__new__(Worker)  # on_failure reads nothing of the instance
    delivery = Delivery("engine-0", 3, None, None)
    lost = GroupFailed("step 2 failed at rank 0 of 2: RuntimeError('Connection reset')")
    with pytest.raises(GroupFailed):
        worker.on_failure(lost, delivery)
    worker.on_failure(ValueError("a plan refused"), delivery)  # any other failure: survived

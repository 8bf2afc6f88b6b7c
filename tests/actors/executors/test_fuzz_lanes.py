"""Fuzzing the lane executors' inboxes: the Worker, the swap lane and the store lane.

Each executor runs on real rings (ring_rig.py) and each example puts a few fuzzed
frames (fuzzing.py) on its inbox, then a real op (the probe), and lets the driver
handle them all. A frame that decodes as one of the lane's ops is numbered by its drawn
role: a repeat (at or below the watermark, zero and negative numbers included), a hole
(past the next number, near or far), or the next number itself with a block id past the
pool planted in it. Whatever the frames were, the executor must have:

- answered every frame the codec refuses with ``Failed`` carrying the codec's error;
- answered a hole with ``rejected`` (the watermark stays), never run a repeat (a repeat
  is answered with the kept completion, a completion lost in a restart, or nothing), and
  refused a planted op with ``rejected``, touching no block (the Worker ``cancelled`` when
  its drawn epoch is older than its own: it cancels a stale plan before checking it);
- then run the probe exactly as it would have without them.

CI runs a short form of each; the slow soak pushes tens of thousands of frames.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from builders import opened
from fuzzing import Form, Fuzz, decode, frames, run_examples
from hypothesis import strategies as st
from ring_rig import RingRig, ring_rig

from ringfence.actors.config import Config
from ringfence.actors.executors.store import StoreLane
from ringfence.actors.executors.swap import SwapLane
from ringfence.actors.executors.worker import Worker
from ringfence.actors.kv.layout import kv_layout
from ringfence.actors.kv.space import SharedKV, create_kv, open_kv
from ringfence.actors.model.decoder import Model
from ringfence.actors.protocol.transfer import (
    FROM_TRANSFER,
    LOST,
    TO_STORE,
    TO_SWAP,
    DeviceTier,
    LaneReady,
    OpDone,
)
from ringfence.actors.protocol.worker import FROM_WORKER, TO_WORKER, StepResult, WorkerReady
from ringfence.cache.fences import NO_WAIT, Tier
from ringfence.cache.ids import BlockHash
from ringfence.runtime.messages import Failed
from ringfence.sched.ops import Piece, StepOp, StoreOp, SwapOp
from ringfence.shm import names
from ringfence.shm.errors import ProtocolError

BLOCKS = 16  # device blocks, and host blocks
SETTINGS = (
    "model.preset=tiny",
    "model.dtype=float64",
    "cache.block_size=4",
    f"cache.device_blocks={BLOCKS}",
    f"cache.host_blocks={BLOCKS}",
    "runtime.heartbeat_s=0.05",
    "runtime.heartbeat_timeout_s=0.6",
)
PROMPT = (17, 3, 200, 41, 9, 88)  # the probe step's prompt: two blocks of 4
ROLES = ("repeat", "zero", "negative", "hole", "far", "next")
# CI: a few dozen frames per executor. The soak: 3,000 for the Worker (each probe is a
# model step) and 7,000 for each lane, at the least. Hypothesis draws about 6 to 7 frames
# per Worker example (420 examples gave 2,526 to 2,957 frames on some draws), so the
# Worker's soak draws 540.
FORMS = [
    pytest.param(Form(examples=8, batches=2, batch=4, frames=8), id="ci"),
    pytest.param(Form(examples=540, batches=3, batch=8, frames=3_000), id="soak",
                 marks=pytest.mark.slow),
]  # fmt: skip
LANE_FORMS = [
    pytest.param(Form(examples=8, batches=2, batch=4, frames=8), id="ci"),
    pytest.param(Form(examples=1_000, batches=3, batch=8, frames=7_000), id="soak",
                 marks=pytest.mark.slow),
]  # fmt: skip


class Sent(NamedTuple):
    seq: int  # transport seq of the frame
    fuzz: Fuzz
    outcome: object  # what the codec makes of it: a message or the ProtocolError
    role: str  # for a lane op: how it was numbered; "" otherwise
    number: int  # the number it carried (0 for anything but a lane op)


def number_of(reply: object) -> int | None:
    if isinstance(reply, StepResult):
        return reply.step
    return reply.op if isinstance(reply, OpDone) else None


class LaneFuzzer:
    """Puts fuzzed frames and probes on one executor's ring and checks every answer.

    ``done`` is the watermark the executor must have once it handled what was put: each
    planted op (role "next") and each probe moves it by one, nothing else does.
    """

    def __init__(self, rig: RingRig, op_cls: type, plant: Any) -> None:
        self.rig, self.op_cls, self.plant = rig, op_cls, plant
        self.stale_first = op_cls is StepOp
        self.field = "step" if op_cls is StepOp else "op"
        self.done = rig.actor.done.value()
        self.kept = rig.actor.kept(self.done)  # the last completion: what its repeat gets
        self.sent: list[Sent] = []
        self.frames = 0

    def number(self, role: str, k: int) -> int:
        done = self.done
        return {
            "repeat": max(1, done - k % max(done, 1)) if done else 0,
            "zero": 0,
            "negative": -1 - k,
            "hole": done + 2 + k % 5,
            "far": 2**40 + k,
            "next": done + 1,
        }[role]

    def put(self, fuzz: Fuzz, role: str, k: int) -> None:
        """One fuzzed frame; a decodable lane op is renumbered for ``role`` (and planted)."""
        rig = self.rig
        self.frames += 1
        outcome = decode(rig.registry, fuzz.kind, fuzz.payload)
        if not isinstance(outcome, self.op_cls):
            self.sent.append(Sent(rig.put(fuzz.kind, fuzz.payload), fuzz, outcome, "", 0))
            return
        op: Any = outcome
        msg = dataclasses.replace(op, **{self.field: self.number(role, k)})
        if role == "next":
            msg = self.plant(msg)
            self.done += 1
        self.sent.append(Sent(rig.post(msg), fuzz, msg, role, getattr(msg, self.field)))

    def probe(self, make: Any) -> object:
        """Put the real op ``make(number)``, handle everything, check every answer; the
        probe's own answer."""
        rig = self.rig
        rig.post(make(self.done + 1))
        self.done += 1
        rig.turn()
        replies = [d.msg for d in rig.take_replies()]
        for s in self.sent:
            self.check(s, replies)
        answer = replies.pop(0)
        assert number_of(answer) == self.done, answer
        assert not replies, f"unexpected answers: {replies}"
        assert rig.actor.done.value() == self.done
        self.kept, self.sent = answer, []
        return answer

    def check(self, s: Sent, replies: list[object]) -> None:
        """Take the answers of fuzzed frame ``s`` off the head of ``replies`` and check them."""
        head: Any = replies[0] if replies else None
        if isinstance(s.outcome, ProtocolError):
            assert isinstance(head, Failed), f"no Failed for {s.fuzz.how}: {s.outcome}; {head}"
            assert head.seq == s.seq and head.error == "ProtocolError", head
            assert head.message == str(s.outcome), s.fuzz.how
            assert s.fuzz.names in head.message, (s.fuzz.how, head.message)
        elif s.role in ("hole", "far", "next"):
            assert number_of(head) == s.number, (s.role, s.number, head)
            # The Worker cancels a stale plan before checking it; the copy lanes check first.
            plan = s.outcome if self.stale_first and s.role == "next" else None
            stale = isinstance(plan, StepOp) and self.rig.actor.stale(plan.epoch)
            assert head.status == ("cancelled" if stale else "rejected"), (s.role, head)
            if s.role == "next":
                self.kept = head
            else:
                assert "is next" in head.error, head
        elif s.role:  # a repeat: the kept completion, a lost one resent, or nothing
            if number_of(head) != s.number:
                return
            # A lost one is resent failed (a prefetch: ok, every block missing).
            lost = isinstance(head, OpDone) and head.error.startswith(LOST)
            assert head == self.kept or (lost and head.status in ("failed", "ok")), (s.role, head)
        elif isinstance(head, WorkerReady | LaneReady):
            pass  # an announcement asked for by a decodable message (a resync)
        else:
            return  # no answer expected (a DeviceTier, say): none taken
        replies.pop(0)


# The Worker.


@pytest.fixture(scope="module")
def reference() -> tuple[int, float]:
    """The probe's token and logprob: greedy, from a contiguous forward of the prompt."""
    model = Model.from_preset("tiny", torch.float64, seed=0).eval()
    logits = model.forward_contiguous(torch.tensor(PROMPT))[-1]
    token = int(torch.argmax(logits))
    return token, float(torch.log_softmax(logits, dim=-1)[token])


@pytest.fixture
def worker_rig(tmp_path: Path, run_id: str) -> Iterator[RingRig]:
    config: Config = Config.load(None, SETTINGS)
    with ring_rig(
        Worker, "worker", config=config, run_id=run_id, log_dir=tmp_path,
        inbox=TO_WORKER, replies=FROM_WORKER,
    ) as rig:  # fmt: skip
        [ready] = [d.msg for d in rig.take_replies()]
        assert isinstance(ready, WorkerReady)
        yield rig
    names.clean_run(run_id)


def plant_in_plan(plan: StepOp) -> StepOp:
    return dataclasses.replace(plan, poison=(*plan.poison, BLOCKS))


def probe_plan(probes: int) -> Any:
    """The probe step: the prompt prefilled into two blocks that rotate over the pool."""
    blocks = (probes % (BLOCKS // 2) * 2, probes % (BLOCKS // 2) * 2 + 1)
    piece = Piece(
        seq_id=1, token_ids=PROMPT, start=0, block_table=blocks, sample=True, opening=opened()
    )
    return blocks, lambda step: StepOp(step=step, epoch=0, fence=NO_WAIT, pieces=(piece,))


def fuzz_the_worker(rig: RingRig, batches: list[list[tuple[Fuzz, str]]], reference) -> int:
    """Every batch then a probe step; returns how many fuzzed frames were put."""
    fuzzer = LaneFuzzer(rig, StepOp, plant_in_plan)
    for probes, batch in enumerate(batches):
        before = rig.actor.kv.clone()
        for k, (fuzz, role) in enumerate(batch):
            fuzzer.put(fuzz, role, k)
        blocks, make = probe_plan(probes)
        result = fuzzer.probe(make)
        assert isinstance(result, StepResult) and result.status == "ok", result
        [out] = result.sampled.tokens()
        assert out.token_id == reference[0] and abs(out.logprob - reference[1]) < 1e-9
        others = [b for b in range(BLOCKS) if b not in blocks]
        assert same_bits(rig.actor.kv[others], before[others]), "a fuzzed frame touched a block"
    return fuzzer.frames


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int64), b.view(torch.int64))


def batches_for(registry, form: Form) -> st.SearchStrategy[list[list[tuple[Fuzz, str]]]]:
    one = st.tuples(frames(registry), st.sampled_from(ROLES))
    batch = st.lists(one, min_size=1, max_size=form.batch)
    return st.lists(batch, min_size=1, max_size=form.batches)


@pytest.mark.parametrize("form", FORMS)
def test_the_worker_survives_fuzzed_plans_answers_each_and_runs_the_next_real_step_exactly(
    worker_rig, reference, form
):
    put = run_examples(
        form, batches_for(TO_WORKER, form), lambda b: fuzz_the_worker(worker_rig, b, reference)
    )
    print(f"worker: {put} fuzzed frames")


# The Transfer lanes.


@pytest.fixture
def lane_rig(tmp_path: Path, run_id: str) -> Iterator[Any]:
    """``make(lane_cls)``: a swap or store lane on rings; the swap lane gets a device tier
    (a pattern in every block) before the first example."""
    opened: list[SharedKV] = []

    @contextlib.contextmanager
    def make(lane_cls: type[SwapLane | StoreLane]) -> Iterator[RingRig]:
        storage = ("cache.storage.backend=local", f"cache.storage.path={tmp_path / 'storage'}")
        config: Config = Config.load(None, [*SETTINGS, *storage])
        inbox = TO_SWAP if lane_cls is SwapLane else TO_STORE
        with ring_rig(
            lane_cls, lane_cls.lane_name, config=config, run_id=run_id, log_dir=tmp_path,
            inbox=inbox, replies=FROM_TRANSFER,
        ) as rig:  # fmt: skip
            [ready] = [d.msg for d in rig.take_replies()]
            assert isinstance(ready, LaneReady)
            opened.append(open_kv(ready.host))
            fill(opened[-1].kv, 0)
            if lane_cls is SwapLane:
                layout = kv_layout(config, Tier.DEVICE)
                name = names.posix_name(run_id, "kv.device.0")
                opened.append(create_kv(layout, "cpu", shm_name=name))
                fill(opened[-1].kv, 1_000)
                rig.post(DeviceTier(epoch=0, kv=opened[-1].handle))
                rig.turn()
                assert not rig.take_replies()
            yield rig

    yield make
    for space in opened:
        space.close()
    names.clean_run(run_id)


def fill(kv: torch.Tensor, seed: int) -> None:
    """A distinct value in every element of every block."""
    kv.copy_(torch.arange(kv.numel(), dtype=kv.dtype).view(kv.shape) + seed * 1e7 + 0.5)


def plant_in_swap(op: SwapOp) -> SwapOp:
    return dataclasses.replace(op, device_blocks=(*op.device_blocks, BLOCKS))


def plant_in_store(op: StoreOp) -> StoreOp:
    return dataclasses.replace(op, host_blocks=(*op.host_blocks, BLOCKS))


def fuzz_the_swap_lane(rig: RingRig, batches: list[list[tuple[Fuzz, str]]]) -> int:
    """Every batch then a probe swap (out and in by turns, two blocks); the copy is exact
    and no other block changed."""
    fuzzer = LaneFuzzer(rig, SwapOp, plant_in_swap)
    device, host = rig.actor.device.kv, rig.actor.host_kv
    for probes, batch in enumerate(batches):
        before = (device.clone(), host.clone())
        for k, (fuzz, role) in enumerate(batch):
            fuzzer.put(fuzz, role, k)
        direction = ("out", "in")[probes % 2]
        d, h = (probes % BLOCKS, (probes + 5) % BLOCKS), ((probes * 3) % BLOCKS, 15 - probes % 8)
        done = fuzzer.probe(lambda op, direction=direction, d=d, h=h: SwapOp(
            op=op, epoch=0, fence=NO_WAIT, direction=direction, device_blocks=d, host_blocks=h,
            reason="admit",
        ))  # fmt: skip
        assert isinstance(done, OpDone) and done.status == "ok", done
        source, target = (before[0], host) if direction == "out" else (before[1], device)
        src, dst = (d, h) if direction == "out" else (h, d)
        assert same_bits(target[list(dst)], source[list(src)])
        for tier, now, was, written in (("device", device, before[0], d), ("host", host,
                                        before[1], h)):  # fmt: skip
            kept = [b for b in range(BLOCKS) if b not in written or tier != target_tier(direction)]
            assert same_bits(now[kept], was[kept]), f"a fuzzed frame touched a {tier} block"
    return fuzzer.frames


def target_tier(direction: str) -> str:
    return "host" if direction == "out" else "device"


def fuzz_the_store_lane(rig: RingRig, batches: list[list[tuple[Fuzz, str]]]) -> int:
    """Every batch then a probe: by turns a write-back of a host block under a new key, and
    a prefetch of that key into another block, which must then hold the same bits."""
    fuzzer = LaneFuzzer(rig, StoreOp, plant_in_store)
    host = rig.actor.host_kv
    written: tuple[BlockHash, int] | None = None
    for probes, batch in enumerate(batches):
        before = host.clone()
        for k, (fuzz, role) in enumerate(batch):
            fuzzer.put(fuzz, role, k)
        block = probes % BLOCKS
        if written is None:
            key = BlockHash(bytes.fromhex(f"{fuzzer.done + 1:016x}{id(fuzzer) % 2**64:016x}"))
            make = lambda op, key=key, block=block: StoreOp(  # noqa: E731
                op=op, epoch=0, fence=NO_WAIT, direction="write", host_blocks=(block,),
                keys=(key,), reason="evict",
            )  # fmt: skip
        else:
            key, source = written
            block = (source + 7) % BLOCKS
            make = lambda op, key=key, block=block: StoreOp(  # noqa: E731
                op=op, epoch=0, fence=NO_WAIT, direction="read", host_blocks=(block,),
                keys=(key,), reason="admit",
            )  # fmt: skip
        done = fuzzer.probe(make)
        assert isinstance(done, OpDone) and done.status == "ok" and not done.missing, done
        others = [b for b in range(BLOCKS) if b != block]
        assert same_bits(host[others], before[others]), "a fuzzed frame touched a host block"
        if written is None:
            written = (key, block)
        else:
            assert same_bits(host[block], before[written[1]])
            written = None
    return fuzzer.frames


@pytest.mark.parametrize("form", LANE_FORMS)
def test_the_swap_lane_survives_fuzzed_ops_answers_each_and_copies_the_next_real_op_exactly(
    lane_rig, form
):
    with lane_rig(SwapLane) as rig:
        put = run_examples(form, batches_for(TO_SWAP, form), lambda b: fuzz_the_swap_lane(rig, b))
    print(f"swap lane: {put} fuzzed frames")


@pytest.mark.parametrize("form", LANE_FORMS)
def test_the_store_lane_survives_fuzzed_ops_answers_each_and_stores_the_next_real_op_exactly(
    lane_rig, form
):
    with lane_rig(StoreLane) as rig:
        put = run_examples(form, batches_for(TO_STORE, form), lambda b: fuzz_the_store_lane(rig, b))
    print(f"store lane: {put} fuzzed frames")


# Found by fuzzing (fixed).


def test_a_device_tier_of_an_epoch_ahead_of_the_run_changes_nothing_for_the_runs_swaps(lane_rig):
    with lane_rig(SwapLane) as rig:
        rig.post(DeviceTier(epoch=9, kv=rig.actor.device.handle))  # the run is in epoch 0
        swap = SwapOp(op=1, epoch=0, fence=NO_WAIT, direction="out", device_blocks=(2,),
                      host_blocks=(3,), reason="preempt")  # fmt: skip
        rig.post(swap)
        rig.turn()
        [done] = [d.msg for d in rig.take_replies()]
        assert isinstance(done, OpDone) and done.status == "ok", done

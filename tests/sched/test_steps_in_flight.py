"""Two steps in flight (``sched.steps_in_flight = 2``): the scheduler plans step N+1 while
step N runs, and a decode of N+1 may take the token N samples (``Piece.pending_from``).

``Lane`` plays the Worker of one device pool: it runs each step when it is issued (the
step lane runs steps in order, so a step never runs before the one it follows), keeps
the tokens of the step it ran last and puts them into the pieces that name it, checks
that every position a piece reads holds the KV of its own sequence (each slot holds the
token prefix whose KV it is), and samples a token that depends only on the sequence's
tokens. Results are applied later, when the test says, as the engine applies them.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field, replace

import pytest
from test_scheduler import (  # type: ignore[import-not-found]  # the sibling module, by pytest
    expected_output,
    make_request,
    next_token,
)

from ringfence.sched.config import SchedConfig, SchedulerConfig, TierConfig
from ringfence.sched.ops import Piece, StepOp
from ringfence.sched.request import Request, RequestState, SamplingParams
from ringfence.sched.scheduler import Scheduler
from ringfence.sched.structured import StructuredOutput

NAMESPACE = b"\0" * 16
BS = 4


def make_scheduler(
    *, steps_in_flight: int = 2, device_blocks: int = 64, poison_freed: bool = True
) -> Scheduler:
    tiers = TierConfig(
        block_size=BS,
        device_blocks=device_blocks,
        host_blocks=1,
        host_cache=False,
        storage=False,
        poison_freed=poison_freed,
    )
    config = SchedulerConfig(
        sched=SchedConfig(max_num_seqs=16, max_batched_tokens=64),
        tiers=tiers,
        namespace=NAMESPACE,
        steps_in_flight=steps_in_flight,
    )
    return Scheduler(config)


@dataclass
class Lane:
    """The Worker and the engine's step lane around one scheduler (module docstring)."""

    sched: Scheduler
    device: dict[int, dict[int, tuple[int, ...]]] = field(default_factory=dict)
    tokens: dict[int, tuple[int, ...]] = field(default_factory=dict)  # seq id -> all tokens
    kept: tuple[int, dict[int, int]] = (0, {})  # the last step run, its sampled tokens
    results: deque[tuple[StepOp, str, list[tuple[int, int]]]] = field(default_factory=deque)
    fail: frozenset[int] = frozenset()  # steps that fail
    issued: list[StepOp] = field(default_factory=list)
    requests: dict[int, Request] = field(default_factory=dict)
    preempted_busy: list[int] = field(default_factory=list)  # preempted while in flight

    def add(self, request: Request) -> int:
        seq_id = self.sched.add(request)
        self.requests[seq_id] = request
        return seq_id

    def schedule(self) -> StepOp | None:
        busy = {
            p.seq_id
            for op, _, _ in self.results
            for p in op.pieces
            if self.requests[p.seq_id].state is RequestState.RUNNING
        }
        ops = self.sched.schedule()
        steps = [op for op in ops if isinstance(op, StepOp)]
        assert len(steps) == len(ops) <= 1, "no transfer tier: only steps"
        for seq_id in busy:
            if self.requests[seq_id].state is RequestState.PREEMPTED:
                self.preempted_busy.append(seq_id)
        if steps:
            self.issued.append(steps[0])
            self.results.append(self.run(steps[0]))
        return steps[0] if steps else None

    def run(self, op: StepOp) -> tuple[StepOp, str, list[tuple[int, int]]]:
        """The Worker: pending inputs put in, KV checked and written, tokens sampled."""
        ran, kept = self.kept
        pieces: list[Piece] = []
        for given in op.pieces:
            p = given
            if p.pending_from:
                if p.pending_from != ran or p.seq_id not in kept:  # fails, as a step raising
                    return self.failed(op)
                p = replace(p, token_ids=(kept[p.seq_id],), pending_from=0)
            pieces.append(p)
        for block in op.poison:
            self.device[block] = {}
        if op.step in self.fail:
            return self.failed(op)
        outputs = []
        for p in pieces:
            known = self.tokens.get(p.seq_id, ())[: p.start] + p.token_ids
            for pos in range(p.start):  # every position it reads holds its own KV
                got = self.device.get(p.block_table[pos // BS], {}).get(pos % BS)
                assert got == known[: pos + 1], f"step {op.step} seq {p.seq_id} position {pos}"
            for pos in range(p.start, p.end):
                self.device.setdefault(p.block_table[pos // BS], {})[pos % BS] = known[: pos + 1]
            self.tokens[p.seq_id] = known
            if p.sample:
                outputs.append((p.seq_id, next_token(known)))
        self.kept = (op.step, dict(outputs))
        return op, "ok", outputs

    def failed(self, op: StepOp) -> tuple[StepOp, str, list[tuple[int, int]]]:
        """The step raised: what it was writing is spoiled, and it sampled nothing."""
        self.kept = (op.step, {})
        for p in op.pieces:
            for block in p.block_table[p.start // BS :]:
                self.device[block] = {}
        return op, "failed", []

    def apply(self) -> None:
        """The engine applies the oldest result."""
        op, status, outputs = self.results.popleft()
        self.sched.on_step(op.step, status, outputs)

    def run_all(self, max_rounds: int = 2000) -> None:
        """Schedule while the lane has room, apply the oldest result, until all are done."""
        for _ in range(max_rounds):
            while self.sched.can_schedule and self.schedule() is not None:
                pass
            if not self.results:
                assert self.sched.num_live == 0, "nothing in flight, nothing scheduled"
                return
            self.apply()
        raise AssertionError("the run did not end")


def workload(seed: int, count: int = 12) -> list[Request]:
    print(f"seed={seed}")
    rng = random.Random(seed)
    return [
        make_request(
            f"r{i}",
            [rng.randrange(1, 50) for _ in range(rng.randrange(1, 14))],
            rng.randrange(1, 9),
        )
        for i in range(count)
    ]


def test_a_decode_takes_the_token_the_step_in_flight_samples() -> None:
    lane = Lane(make_scheduler())
    lane.add(make_request("a", [5, 6, 7], max_tokens=3))
    first = lane.schedule()
    second = lane.schedule()
    assert first is not None and second is not None
    (prefill,) = first.pieces
    (decode,) = second.pieces
    assert (prefill.start, len(prefill.token_ids), prefill.sample) == (0, 3, True)
    assert (decode.start, decode.token_ids, decode.pending_from) == (3, (0,), first.step)
    assert decode.block_table == prefill.block_table  # position 3 is in the first block
    assert decode.sample and decode.opening is None
    assert not lane.sched.can_schedule
    with pytest.raises(RuntimeError, match="2 steps in flight"):
        lane.sched.schedule()


def test_the_last_decode_planned_is_the_one_max_tokens_needs() -> None:
    lane = Lane(make_scheduler())
    lane.add(make_request("a", [5, 6, 7], max_tokens=3))
    lane.run_all()
    starts = [[(p.start, p.pending_from) for p in op.pieces] for op in lane.issued]
    assert starts == [[(0, 0)], [(3, 1)], [(4, 2)]]  # no fourth decode past max_tokens
    assert lane.requests[0].output_token_ids == expected_output((5, 6, 7), 3)


def test_a_sequence_the_step_finishes_has_the_next_steps_token_dropped() -> None:
    lane = Lane(make_scheduler())
    prompt = (5, 6, 7)
    stop = expected_output(prompt, 2)[1]  # its second token stops it
    params = SamplingParams(max_tokens=8, stop_token_ids=(stop,))
    lane.add(Request(request_id="a", prompt_token_ids=prompt, params=params))
    lane.run_all()
    request = lane.requests[0]
    assert request.finish_reason == "stop"
    assert request.output_token_ids == expected_output(prompt, 2)
    assert [[p.start for p in op.pieces] for op in lane.issued] == [[0], [3], [4]]
    assert lane.sched.blocks.device.num_free == 64  # the third step's block freed with it


def test_the_next_step_closes_a_sequence_that_a_dropped_decode_ran_for() -> None:
    lane = Lane(make_scheduler())
    lane.add(make_request("a", [5, 6, 7], max_tokens=2))
    lane.add(make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], max_tokens=8))
    lane.run_all()
    closing = [op.step for op in lane.issued if 0 in op.closed]
    last_of_a = max(op.step for op in lane.issued if any(p.seq_id == 0 for p in op.pieces))
    assert closing and closing[0] > last_of_a


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_two_in_flight_give_every_request_the_plain_loops_tokens(seed: int) -> None:
    one, two = Lane(make_scheduler(steps_in_flight=1)), Lane(make_scheduler())
    for lane in (one, two):
        for request in workload(seed):
            lane.add(request)
        lane.run_all()
    for seq_id, request in two.requests.items():
        wanted = expected_output(request.prompt_token_ids, request.params.max_tokens)
        assert request.output_token_ids == wanted
        assert one.requests[seq_id].output_token_ids == wanted
    assert any(p.pending_from for op in two.issued for p in op.pieces)
    assert not any(p.pending_from for op in one.issued for p in op.pieces)
    assert len(two.issued) < len(one.issued) + 8  # one extra step at most a request's end


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_under_preemption_no_sequence_of_a_step_in_flight_is_preempted(seed: int) -> None:
    lane = Lane(make_scheduler(device_blocks=10))
    for request in workload(seed, count=8):
        lane.add(request)
    lane.run_all()
    assert lane.sched.counters.preemptions["recompute"] > 0, "the pool must run short"
    assert lane.preempted_busy == []
    for request in lane.requests.values():
        assert request.output_token_ids == expected_output(
            request.prompt_token_ids, request.params.max_tokens
        )


def test_a_failed_step_voids_the_step_after_it_and_the_sequences_are_computed_again() -> None:
    lane = Lane(make_scheduler(), fail=frozenset({3}))
    lane.add(make_request("a", [5, 6, 7], max_tokens=6))
    lane.add(make_request("b", [9, 8], max_tokens=6))
    lane.schedule()
    lane.schedule()
    lane.apply()  # step 1
    lane.schedule()  # step 3: decodes step 2's tokens; it fails
    lane.apply()  # step 2
    step4 = lane.schedule()  # decodes step 3's tokens: the Worker will fail it
    assert step4 is not None and all(p.pending_from == 3 for p in step4.pieces)
    lane.apply()  # step 3 failed: step 4 is void, both sequences wait again
    assert lane.results[0][1] == "failed"  # it lacked step 3's tokens
    assert lane.sched.num_running == 0 and lane.sched.num_waiting == 2
    step5 = lane.schedule()  # beside the void step 4: both computed again from scratch
    assert step5 is not None and [(p.start, p.pending_from) for p in step5.pieces] == [
        (0, 0),
        (0, 0),
    ]
    lane.apply()  # step 4's, dropped
    lane.run_all()
    for request in lane.requests.values():
        assert request.state is RequestState.FINISHED
        assert request.output_token_ids == expected_output(request.prompt_token_ids, 6)
    assert lane.sched.counters.retries == 2


def test_a_failed_step_with_nothing_planned_after_it_is_retried_as_before() -> None:
    lane = Lane(make_scheduler(), fail=frozenset({1}))
    lane.add(make_request("a", [5, 6, 7], max_tokens=2))
    lane.run_all()
    assert lane.requests[0].output_token_ids == expected_output((5, 6, 7), 2)
    assert lane.issued[1].pieces[0].pending_from == 1  # voided, never applied


def test_a_device_reset_drops_both_steps_in_flight() -> None:
    lane = Lane(make_scheduler())
    lane.add(make_request("a", [5, 6, 7], max_tokens=4))
    lane.schedule()
    lane.schedule()
    lane.apply()
    lane.schedule()
    assert lane.sched.num_steps_in_flight == 2
    assert [r.request_id for r in lane.sched.reset_device()] == ["a"]
    assert lane.sched.num_steps_in_flight == 0 and lane.sched.step_in_flight is None
    lane.results.clear()
    lane.device.clear()
    lane.kept = (0, {})
    lane.run_all()
    assert lane.requests[0].output_token_ids == expected_output((5, 6, 7), 4)


def test_a_structured_output_decodes_one_step_at_a_time() -> None:
    lane = Lane(make_scheduler())
    params = SamplingParams(
        max_tokens=3, structured=StructuredOutput(kind="regex", source="[a-z]+")
    )
    lane.add(Request(request_id="a", prompt_token_ids=(5, 6, 7), params=params))
    assert lane.schedule() is not None
    assert lane.schedule() is None  # nothing to plan before its token is known
    lane.run_all()
    assert not any(p.pending_from for op in lane.issued for p in op.pieces)


def test_a_pending_decode_keys_the_block_it_fills_once_its_token_is_applied() -> None:
    lane = Lane(make_scheduler())
    lane.add(make_request("a", [5, 6, 7], max_tokens=3))
    lane.schedule()
    lane.schedule()  # fills position 3: the first block is full
    seq = lane.sched.queues.seqs[0]
    assert seq.num_keyed == 0
    lane.apply()
    assert seq.num_keyed == 1 and len(seq.keys) == 1


def test_one_in_flight_is_the_default_and_refuses_a_second() -> None:
    sched = make_scheduler(steps_in_flight=1)
    assert SchedConfig().steps_in_flight == 1
    sched.add(make_request("a", [5, 6, 7], max_tokens=3))
    assert sched.schedule()
    assert not sched.can_schedule
    with pytest.raises(RuntimeError, match=r"sched\.steps_in_flight is 1"):
        sched.schedule()


@pytest.mark.parametrize("seed", range(20, 32))
def test_under_random_failures_aborts_resets_and_a_short_pool_every_token_is_the_plain_ones(
    seed: int,
) -> None:
    """Seeded: steps fail at random, requests are aborted at random, the device is reset
    once, and the pool is short; every request that was not aborted ends with exactly the
    tokens of the one-at-a-time loop, and every read the Worker makes finds its own KV."""
    rng = random.Random(seed)
    lane = Lane(make_scheduler(device_blocks=12), fail=frozenset(rng.sample(range(1, 120), 8)))
    requests = workload(seed, count=10)
    for request in requests:
        lane.add(request)
    doomed = set(rng.sample([r.request_id for r in requests], 2))
    reset_at = rng.randrange(5, 40)
    for rounds in range(3000):
        while lane.sched.can_schedule and lane.schedule() is not None:
            pass
        if rounds == reset_at:
            lane.sched.reset_device()
            lane.results.clear()
            lane.device.clear()
            lane.kept = (0, {})
            continue
        if doomed and rng.random() < 0.1:
            lane.sched.abort(doomed.pop())
        if not lane.results:
            if lane.sched.num_live == 0:
                break
            continue
        lane.apply()
    assert lane.sched.num_live == 0
    assert lane.preempted_busy == []
    for request in lane.requests.values():
        if request.state is RequestState.ABORTED:
            continue
        assert request.output_token_ids == expected_output(
            request.prompt_token_ids, request.params.max_tokens
        ), request.request_id

"""The engine's issuing ledger, per (lane, rank): credits, completions counted once per rank,
an op applied only once every rank reported it, and its outcome combined over the ranks."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest

from ringfence.actors.engine.ledger import CREDITS, Ledger
from ringfence.actors.protocol.transfer import OpDone
from ringfence.actors.protocol.worker import FROM_WORKER, Sampled, SampledToken, StepResult
from ringfence.cache.fences import NO_WAIT, Fence, Lane
from ringfence.cache.ids import BlockHash, Seq
from ringfence.runtime.log import ActorLog
from ringfence.sched.ops import Op, Piece, StepOp, StoreOp, SwapOp


def make_ledger(tmp_path: Path, ranks: int = 2, *, sync: bool = False):
    sent: list[tuple[str, object]] = []
    log = ActorLog(tmp_path / "engine-0.jsonl", actor="engine", rank=0, epoch=0)
    ledger = Ledger(
        ranks, sync=sync, send_all=lambda role, ms: sent.extend((role, m) for m in ms), log=log
    )
    ledger.begin({Lane.STEP: 1, Lane.SWAP: 1, Lane.STORE: 1})
    return ledger, sent, log


def stale(log: ActorLog) -> list[str]:
    log.flush()
    assert log.path is not None
    lines = [orjson.loads(line) for line in log.path.read_bytes().splitlines()]
    return [line["why"] for line in lines if line["event"] == "engine.stale"]


def step(n: int, fence: Fence = NO_WAIT) -> StepOp:
    piece = Piece(seq_id=1, token_ids=(1,), start=0, block_table=(0,), sample=True)
    return StepOp(step=n, fence=fence, pieces=(piece,))


def prefetch(n: int) -> StoreOp:
    keys = tuple(BlockHash(bytes([i]) * 16) for i in range(3))
    return StoreOp(
        op=n, fence=NO_WAIT, direction="read", host_blocks=(0, 1, 2), keys=keys, reason="admit"
    )


def swap(n: int, fence: Fence = NO_WAIT) -> SwapOp:
    return SwapOp(
        op=n, fence=fence, direction="in", device_blocks=(n,), host_blocks=(n,), reason="admit"
    )


def result(n: int, rank: int, status: str = "ok", epoch: int = 0, token: int = 7) -> StepResult:
    sampled = Sampled.of([SampledToken(seq_id=1, position=1, token_id=token, logprob=0.0)])
    return StepResult(step=n, epoch=epoch, rank=rank, status=status, sampled=sampled)  # type: ignore[arg-type]


def done(lane: str, n: int, rank: int, status: str = "ok", missing: tuple[int, ...] = ()) -> OpDone:
    return OpDone(lane=lane, op=n, epoch=0, rank=rank, status=status, missing=missing, bytes=10)  # type: ignore[arg-type]


def test_an_op_goes_to_every_rank_stamped_with_the_epoch_it_was_issued_in(tmp_path):
    ledger, sent, _ = make_ledger(tmp_path)
    ledger.queue([step(1)], epoch=3)
    ledger.pump()
    assert [(role, type(m).__name__, m.epoch) for role, m in sent] == [("worker", "StepOp", 3)]  # type: ignore[attr-defined]
    assert ledger.in_flight(Lane.STEP) == 1


def test_a_step_is_applied_only_when_every_rank_has_reported_it_with_rank_0s_tokens(tmp_path):
    ledger, _, _ = make_ledger(tmp_path)
    ledger.queue([step(1)], epoch=0)
    ledger.pump()
    assert ledger.settle(Lane.STEP, 1, result(1, 1, token=99), epoch_now=0) is None
    assert ledger.in_flight(Lane.STEP) == 1  # rank 0 still runs it: no credit back yet
    outcome = ledger.settle(Lane.STEP, 0, result(1, 0, token=7), epoch_now=0)
    assert outcome is not None and outcome.status == "ok"
    assert [t.token_id for t in outcome.sampled.tokens()] == [7]
    assert ledger.in_flight(Lane.STEP) == 0 and ledger.completed(Lane.STEP) == 1


def test_a_result_whose_token_columns_differ_in_length_is_a_failed_step(tmp_path):
    ledger, _, _ = make_ledger(tmp_path)
    ledger.queue([step(1)], epoch=0)
    ledger.pump()
    assert ledger.settle(Lane.STEP, 1, result(1, 1), epoch_now=0) is None  # rank 1's
    good = result(1, 0, token=7)
    torn = dataclasses.replace(good.sampled, token_ids=(7, 8))
    outcome = ledger.settle(Lane.STEP, 0, dataclasses.replace(good, sampled=torn), epoch_now=0)
    assert outcome is not None and outcome.status == "failed" and len(outcome.sampled) == 0
    assert "sampled columns of unequal lengths" in outcome.error
    assert "'token_ids': 2" in outcome.error and "'seq_ids': 1" in outcome.error


def test_the_sampled_columns_cross_the_wire_and_read_back_as_the_tokens_they_were():
    tokens = [
        SampledToken(seq_id=4, position=9, token_id=3, logprob=-0.25, rank=2, top=((3, -0.25),)),
        SampledToken(seq_id=1, position=2, token_id=5, logprob=-1.5),
    ]
    sampled = Sampled.of(tokens)
    assert sampled.tokens() == tuple(tokens) and sampled.problem() == ""
    assert sampled.pairs() == [(4, 3), (1, 5)] and len(sampled) == 2
    sent = StepResult(step=3, epoch=0, rank=0, status="ok", sampled=sampled)
    assert FROM_WORKER.decode(*FROM_WORKER.encode(sent)) == sent


def test_a_rank_that_reports_twice_is_counted_once(tmp_path):
    ledger, _, log = make_ledger(tmp_path)
    ledger.queue([step(1)], epoch=0)
    ledger.pump()
    assert ledger.settle(Lane.STEP, 1, result(1, 1), epoch_now=0) is None
    assert ledger.settle(Lane.STEP, 1, result(1, 1), epoch_now=0) is None  # a restarted rank 1
    assert ledger.completed(Lane.STEP) == 0  # rank 0 has not reported: not complete
    assert stale(log) == ["a repeat: step is complete up to 1 at rank 1"]
    assert ledger.settle(Lane.STEP, 0, result(1, 0), epoch_now=0) is not None


def test_a_prefetch_lacks_what_any_rank_lacks_and_fails_if_any_rank_failed(tmp_path):
    ledger, _, _ = make_ledger(tmp_path)
    ledger.queue([prefetch(1), prefetch(2)], epoch=0)
    ledger.pump()
    assert ledger.settle(Lane.STORE, 0, done("store", 1, 0, missing=(2,)), epoch_now=0) is None
    first = ledger.settle(Lane.STORE, 1, done("store", 1, 1, missing=(0,)), epoch_now=0)
    assert first is not None and (first.status, first.missing, first.bytes) == ("ok", (0, 2), 20)
    assert ledger.settle(Lane.STORE, 1, done("store", 2, 1, "failed"), epoch_now=0) is None
    second = ledger.settle(Lane.STORE, 0, done("store", 2, 0), epoch_now=0)
    assert second is not None and second.status == "failed"


def test_credits_are_per_lane_and_a_lagging_rank_holds_them(tmp_path):
    ledger, sent, _ = make_ledger(tmp_path)
    ledger.queue([swap(n) for n in range(1, CREDITS[Lane.SWAP] + 2)], epoch=0)
    ledger.pump()
    assert len(sent) == CREDITS[Lane.SWAP] and ledger.waiting()
    ledger.settle(Lane.SWAP, 0, done("swap", 1, 0), epoch_now=0)
    ledger.pump()
    assert len(sent) == CREDITS[Lane.SWAP]  # rank 1 still has op 1 in flight
    ledger.settle(Lane.SWAP, 1, done("swap", 1, 1), epoch_now=0)
    ledger.pump()
    assert len(sent) == CREDITS[Lane.SWAP] + 1 and not ledger.waiting()


def test_in_sync_mode_an_op_waits_until_its_fence_is_complete_on_every_rank(tmp_path):
    ledger, sent, _ = make_ledger(tmp_path, sync=True)
    ledger.queue([swap(1), step(1, Fence(swap=Seq(1)))], epoch=0)
    ledger.pump()
    assert [type(m).__name__ for _, m in sent] == ["SwapOp"]
    ledger.settle(Lane.SWAP, 0, done("swap", 1, 0), epoch_now=0)
    ledger.pump()
    assert len(sent) == 1  # rank 1's swap-in may still be copying
    ledger.settle(Lane.SWAP, 1, done("swap", 1, 1), epoch_now=0)
    ledger.pump()
    role, plan = sent[-1]
    assert role == "worker" and isinstance(plan, StepOp) and plan.fence == NO_WAIT


@pytest.mark.parametrize(
    ("report", "why"),
    [
        (result(2, 0), "never sent: the last step op sent is 1"),
        (result(1, 2), "from rank 2; the lane has 2"),
        (result(1, 0, epoch=5), "the op was sent with epoch 0, not 5"),
    ],
    ids=["never-sent", "no-such-rank", "other-epoch"],
)
def test_a_report_of_no_op_in_flight_is_logged_and_not_counted(tmp_path, report, why):
    ledger, _, log = make_ledger(tmp_path)
    ledger.queue([step(1)], epoch=0)
    ledger.pump()
    assert ledger.settle(Lane.STEP, report.rank, report, epoch_now=0) is None
    assert stale(log) == [why]
    assert ledger.in_flight(Lane.STEP) == 1


def test_an_op_of_an_older_epoch_is_counted_but_not_applied(tmp_path):
    ledger, _, log = make_ledger(tmp_path, ranks=1)
    ledger.queue([step(1)], epoch=0)
    ledger.pump()
    assert ledger.settle(Lane.STEP, 0, result(1, 0), epoch_now=1) is None
    assert ledger.in_flight(Lane.STEP) == 0
    assert stale(log) == ["of epoch 0, the engine's is 1"]


def test_a_restarted_rank_completes_what_its_watermark_covers_for_that_rank_alone(tmp_path):
    ledger, _, _ = make_ledger(tmp_path)
    ops: list[Op] = [step(1)]
    ledger.queue(ops, epoch=0)
    ledger.pump()
    ledger.complete_up_to(Lane.STEP, 1, 1)  # Worker rank 1 restarted with step_done = 1
    assert ledger.completed(Lane.STEP) == 0
    ledger.complete_up_to(Lane.STEP, 0, 1)
    assert ledger.completed(Lane.STEP) == 1 and ledger.in_flight(Lane.STEP) == 0


def test_a_pump_sends_each_lanes_credited_ops_as_one_batch_in_issue_order(tmp_path):
    calls: list[tuple[str, list[int]]] = []

    def send_all(role: str, msgs: list[object]) -> None:
        calls.append((role, [getattr(m, "op") for m in msgs]))  # noqa: B009 - ops of any lane

    log = ActorLog(tmp_path / "engine-0.jsonl", actor="engine", rank=0, epoch=0)
    ledger = Ledger(2, sync=False, send_all=send_all, log=log)
    ledger.begin({Lane.STEP: 1, Lane.SWAP: 1, Lane.STORE: 1})
    ledger.queue([swap(1), prefetch(1), swap(2), swap(3)], epoch=0)
    ledger.pump()
    assert sorted(calls) == [("store", [1]), ("swap", [1, 2, 3])]  # one send_all a lane

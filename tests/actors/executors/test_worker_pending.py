"""The Worker with two steps in flight: a decode planned before its input was known names
the step that samples it (``Piece.pending_from``), and the Worker puts in the token it
sampled there (``actors/executors/pending.py``), or fails the plan naming what it lacks,
spoiling the blocks it would have written as a failed step does.

The rig is test_worker's: a Worker in a thread on a real driver, the test playing the
Engine; tokens are compared with a contiguous forward in float64.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from builders import opened
from test_worker import (  # type: ignore[import-not-found]  # the sibling module, by pytest
    Seq,
    check_against_reference,
    make_rig,
    reference,
)

from ringfence.actors.executors.pending import MissingToken, SampledTokens, with_token
from ringfence.actors.protocol.lanes import ISSUER_EPOCH, epoch_counter
from ringfence.actors.protocol.worker import StepResult
from ringfence.cache.fences import Fence
from ringfence.cache.ids import Seq as SeqNo
from ringfence.sched.ops import Piece, StepOp

__all__ = ["make_rig", "reference"]  # the fixtures this module's tests take

PROMPT = [3, 1, 4, 1, 5]


def prefill(seq: Seq) -> Piece:
    return Piece(
        seq_id=seq.seq_id,
        token_ids=tuple(seq.prompt),
        start=0,
        block_table=tuple(seq.blocks),
        sample=True,
        opening=opened(len(seq.prompt)),
    )


def pending(seq: Seq, start: int, step: int) -> Piece:
    return Piece(
        seq_id=seq.seq_id,
        token_ids=(0,),
        start=start,
        block_table=tuple(seq.blocks),
        sample=True,
        pending_from=step,
    )


def plan(step: int, *pieces: Piece) -> StepOp:
    return StepOp(step=step, epoch=0, fence=Fence(), pieces=pieces)


def test_a_piece_with_its_token_put_in_keeps_every_other_field_as_replace_would():
    piece = Piece(
        seq_id=9,
        token_ids=(0,),
        start=40,
        block_table=(7, 3, 11),
        sample=True,
        opening=opened(12),
        pending_from=5,
    )
    made = with_token(piece, 42)
    assert made == replace(piece, token_ids=(42,), pending_from=0)
    assert (made.token_ids, made.pending_from, made.opening) == ((42,), 0, piece.opening)


def test_decodes_planned_ahead_take_the_tokens_the_step_before_sampled(make_rig, reference):
    rig = make_rig()
    seqs = [Seq(0, PROMPT, [0, 1, 2]), Seq(1, [2, 7, 1, 8], [3, 4, 5])]
    rig.post(plan(1, *(prefill(s) for s in seqs)))  # both plans in the ring at once
    rig.post(plan(2, *(pending(s, len(s.prompt), 1) for s in seqs)))
    rig.post(plan(3, *(pending(s, len(s.prompt) + 1, 2) for s in seqs)))
    for step in (1, 2, 3):
        take_tokens(rig.result(step), seqs)
    for seq in seqs:
        check_against_reference(reference, seq)


def take_tokens(result, seqs: list[Seq]) -> None:
    """Append an ok step's token and logprob to each of ``seqs``."""
    assert result.status == "ok", result.error
    by_id = {out.seq_id: out for out in result.sampled.tokens()}
    for seq in seqs:
        seq.generated.append(by_id[seq.seq_id].token_id)
        seq.logprobs.append(by_id[seq.seq_id].logprob)


def test_a_plan_naming_a_step_it_did_not_run_last_fails_saying_so(make_rig):
    rig = make_rig()
    seq = Seq(0, PROMPT, [0, 1])
    rig.post(plan(1, prefill(seq)))
    assert rig.result(1).status == "ok"
    rig.post(plan(2, pending(seq, len(PROMPT), 7)))
    result = rig.result(2)
    assert result.status == "failed"
    assert "step 7 sampled, but the last step this Worker ran is 1" in result.error


def test_a_plan_after_a_step_that_sampled_nothing_spoils_what_it_would_write(make_rig):
    rig = make_rig()
    seq, other = Seq(0, [3, 1, 4, 1], [0, 1]), Seq(1, [9, 9], [2])
    rig.post(plan(1, prefill(seq), prefill(other)))
    assert rig.result(1).status == "ok"
    kept = rig.kv[0].clone()  # positions 0..3: only read by the decode at position 4
    rig.post(plan(2, replace(pending(other, 2, 1), block_table=(99,))))
    assert rig.result(2).status == "rejected"  # a block outside the pool: it sampled nothing
    rig.post(plan(3, pending(seq, len(seq.prompt), 2)))
    result = rig.result(3)
    assert result.status == "failed"
    assert "which sampled none for it" in result.error
    # A copy fenced on step 3 finds NaN in the block it was to write, not older KV.
    assert bool(rig.kv[1].isnan().all())
    assert torch.equal(rig.kv[0], kept)


def test_sampled_tokens_keep_only_the_last_step() -> None:
    tokens = SampledTokens()
    seq = Seq(0, PROMPT, [0])
    tokens.keep(1, [(0, 42)])
    resolved = tokens.resolve(plan(2, pending(seq, 5, 1)))
    assert [(p.token_ids, p.pending_from) for p in resolved.pieces] == [((42,), 0)]
    tokens.keep(2, [])
    with pytest.raises(MissingToken, match="the last step this Worker ran is 2"):
        tokens.resolve(plan(3, pending(seq, 5, 1)))
    whole = plan(3, prefill(seq))
    assert tokens.resolve(whole) is whole  # nothing pending: the plan as it came


LAUNCH_AHEAD = ("model.look_ahead=on", "model.launch_ahead=on")  # auto: on a GPU only


def launched_ahead(rig) -> dict[int, bool]:
    return {e["step"]: bool(e.get("launched_ahead")) for e in rig.events("step.done")}


def test_a_step_launched_ahead_takes_the_tokens_and_one_whose_fence_waits_is_not(
    make_rig, reference
):
    rig = make_rig(*LAUNCH_AHEAD)
    seqs = [Seq(0, PROMPT, [0, 1, 2]), Seq(1, [2, 7, 1, 8], [3, 4, 5])]
    rig.post(plan(1, *(prefill(s) for s in seqs)))  # every plan in the ring at once
    rig.post(plan(2, *(pending(s, len(s.prompt), 1) for s in seqs)))
    waits = replace(plan(3, *(pending(s, len(s.prompt) + 1, 2) for s in seqs)), fence=Fence(
        swap=SeqNo(1)
    ))  # fmt: skip
    rig.post(waits)
    for step in (1, 2, 3):
        if step == 3:
            rig.swap_in(1)  # its fence: met only now, after step 2 was reported
        take_tokens(rig.result(step), seqs)
    for seq in seqs:
        check_against_reference(reference, seq)
    # Step 2 was launched as step 1 ended; step 3 waited for its fence at its own turn.
    assert launched_ahead(rig) == {1: False, 2: True, 3: False}


def launched_decode(rig, then) -> tuple[StepResult, list[int]]:
    """Step 1 (a prefill) then step 2 (its decode, pending), both in the ring, on a rig that
    launches ahead; ``then()`` runs right after step 2's forward is called. Step 2's result,
    and step_done at that call: 0 when step 2 was launched before step 1 was reported."""
    seq = Seq(0, PROMPT, [0, 1])
    step = rig.worker.device.executor.step
    done_at_decode: list[int] = []

    def wrapped(pieces, **kwargs):
        if pieces[0].start != len(PROMPT):
            return step(pieces, **kwargs)
        done_at_decode.append(rig.worker.done.value())
        out = step(pieces, **kwargs)
        then()
        return out

    rig.worker.device.executor.step = wrapped
    rig.post(plan(1, prefill(seq)))
    rig.post(plan(2, pending(seq, len(PROMPT), 1)))
    assert rig.result(1).status == "ok"
    return rig.result(2), done_at_decode


def test_a_launch_ahead_that_raises_fails_its_step_at_its_turn_spoiling_its_writes(make_rig):
    rig = make_rig(*LAUNCH_AHEAD)

    def device_gone() -> None:
        raise RuntimeError("the device is gone")

    result, done_at_decode = launched_decode(rig, device_gone)
    assert done_at_decode == [0]  # launched ahead: before step 1 was reported
    assert result.status == "failed" and "the device is gone" in result.error
    assert bool(rig.kv[1].isnan().all())  # position 5's block: spoiled, not half-written
    assert launched_ahead(rig) == {1: False, 2: False}  # a failed step is not reported so


def test_a_step_launched_ahead_whose_epoch_goes_stale_fails_spoiling_its_writes(make_rig):
    rig = make_rig(*LAUNCH_AHEAD)
    epoch = epoch_counter(rig.lanes, 0, ISSUER_EPOCH)
    epoch.claim()
    result, done_at_decode = launched_decode(rig, lambda: epoch.advance(1))  # a new engine
    assert done_at_decode == [0]
    assert result.status == "failed" and "StaleLaunch" in result.error
    assert "issued before the engine restarted at epoch 1" in result.error
    assert bool(rig.kv[1].isnan().all())  # it ran: what it wrote is spoiled

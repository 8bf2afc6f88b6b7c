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
from ringfence.actors.executors.sampling import NonFiniteLogits
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
LAUNCH_LATE = ("model.look_ahead=on", "model.launch_ahead=late")


def launched_ahead(rig) -> dict[int, str | None]:
    return {e["step"]: e.get("launched_ahead") for e in rig.events("step.done")}


def post_together(rig, first: StepOp, *rest: StepOp) -> None:
    """Put every plan in the ring before the first runs: it waits for swap op 1, which is
    done only once the others are posted (so the look-ahead finds the second, by design
    and not by timing)."""
    rig.post(replace(first, fence=Fence(swap=SeqNo(1))))
    for p in rest:
        rig.post(p)
    rig.swap_in(1)


@pytest.mark.parametrize(("settings", "how"), [(LAUNCH_AHEAD, "early"), (LAUNCH_LATE, "late")])
def test_a_step_launched_ahead_takes_the_tokens_and_one_whose_fence_waits_is_not(
    make_rig, reference, settings, how
):
    # "early": step 2 is launched while step 1 lands, before step 1's tokens are read back,
    # its inputs gathered from step 1's draw on the device; "late": once they are read.
    rig = make_rig(*settings)
    seqs = [Seq(0, PROMPT, [0, 1, 2]), Seq(1, [2, 7, 1, 8], [3, 4, 5])]
    waits = replace(plan(3, *(pending(s, len(s.prompt) + 1, 2) for s in seqs)), fence=Fence(
        swap=SeqNo(2)
    ))  # fmt: skip
    post_together(
        rig,
        plan(1, *(prefill(s) for s in seqs)),
        plan(2, *(pending(s, len(s.prompt), 1) for s in seqs)),
        waits,
    )
    for step in (1, 2, 3):
        if step == 3:
            rig.swap_in(2)  # its fence: met only now, after step 2 was reported
        take_tokens(rig.result(step), seqs)
    for seq in seqs:
        check_against_reference(reference, seq)
    # Step 2 was launched as step 1 ended; step 3 waited for its fence at its own turn.
    assert launched_ahead(rig) == {1: None, 2: how, 3: None}


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
    post_together(rig, plan(1, prefill(seq)), plan(2, pending(seq, len(PROMPT), 1)))
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
    assert launched_ahead(rig) == {1: None, 2: None}  # a failed step is not reported so


def test_a_step_launched_ahead_whose_epoch_goes_stale_fails_spoiling_its_writes(make_rig):
    rig = make_rig(*LAUNCH_AHEAD)
    epoch = epoch_counter(rig.lanes, 0, ISSUER_EPOCH)
    epoch.claim()
    result, done_at_decode = launched_decode(rig, lambda: epoch.advance(1))  # a new engine
    assert done_at_decode == [0]
    assert result.status == "failed" and "StaleLaunch" in result.error
    assert "issued before the engine restarted at epoch 1" in result.error
    assert bool(rig.kv[1].isnan().all())  # it ran: what it wrote is spoiled


def test_a_step_launched_behind_one_that_then_fails_fails_too_spoiling_its_writes(make_rig):
    # Step 2 is launched while step 1 lands, on step 1's draw on the device; step 1 then
    # fails as its tokens are read (as non-finite logits would make it): step 2 ran on a
    # token never sampled, so it fails at its turn and what it wrote is spoiled.
    rig = make_rig(*LAUNCH_AHEAD)
    seq = Seq(0, PROMPT, [0, 1])
    sampler = rig.worker.device.sampler
    collect = sampler.collect
    launched_at_collect: list[bool] = []

    def failing(draw):
        if draw is not None and draw.pieces[0].start == 0:  # step 1's, the prefill's
            launched_at_collect.append(rig.worker.launched is not None)
            raise NonFiniteLogits("the logits of sequence 0 are not finite (made so)")
        return collect(draw)

    sampler.collect = failing
    post_together(rig, plan(1, prefill(seq)), plan(2, pending(seq, len(PROMPT), 1)))
    first = rig.result(1)
    assert first.status == "failed" and "made so" in first.error
    result = rig.result(2)
    assert launched_at_collect == [True]  # step 2 was queued before step 1's tokens were read
    assert result.status == "failed" and "LaunchedBehindFailure" in result.error
    assert "launched while step 1 was on the device" in result.error
    assert bool(rig.kv[1].isnan().all())  # position 5's block: spoiled, not kept as computed


def test_a_sequence_closed_by_a_step_and_opened_by_the_next_launched_early_stays_open(
    make_rig, reference
):
    # Step 2 closes sequence 1 and step 3 opens it again (a preemption and a readmission):
    # step 3 is launched while step 2 lands, so step 2's end must not forget what step 3
    # opened, or step 4's decode of it would find no sampling params.
    rig = make_rig(*LAUNCH_AHEAD)
    keep, gone = Seq(0, PROMPT, [0, 1, 2]), Seq(1, [2, 7, 1, 8], [3, 4, 5])
    again = Seq(1, [2, 7, 1, 8], [3, 4, 5])  # its second life, from its prompt
    post_together(
        rig,
        plan(1, prefill(keep), prefill(gone)),
        replace(plan(2, pending(keep, len(PROMPT), 1)), closed=(1,)),
        plan(3, pending(keep, len(PROMPT) + 1, 2), prefill(again)),
        plan(4, pending(keep, len(PROMPT) + 2, 3), pending(again, len(again.prompt), 3)),
    )
    take_tokens(rig.result(1), [keep, gone])
    take_tokens(rig.result(2), [keep])
    take_tokens(rig.result(3), [keep, again])
    take_tokens(rig.result(4), [keep, again])
    for seq in (keep, again):
        check_against_reference(reference, seq)
    assert launched_ahead(rig) == {1: None, 2: "early", 3: "early", 4: "early"}

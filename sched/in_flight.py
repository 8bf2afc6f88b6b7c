"""The steps issued whose results are not applied yet, and the decodes planned ahead of
their inputs (``sched.steps_in_flight``).

With ``sched.steps_in_flight = 2`` the engine may schedule step N+1 while step N runs (a
GPU then never waits for the engine). A running sequence whose piece in N samples a token
gets a decode in N+1 whose input is that token, still unknown (``Piece.pending_from``;
the Worker puts it in), with blocks for its position as for any decode; none is planned
for a sequence N's token brings to ``max_tokens``, nor for one with a structured output
(on a device the grammar's mask for N+1 needs N's token on the host first). Applying N
applies N's tokens: the one N+1 decodes counts as computed then (its full block keyed),
and a sequence N finishes has N+1's token dropped (its blocks are freed at once, fenced
like any other op's). A sequence in a step in flight is never preempted for the next one
(its token would come for a sequence no longer running; a failed step's bookkeeping would
find it requeued). If N did not come back ``ok``, N+1 is void: every sequence of it that
still runs is computed again (requeued, its copies forgotten), and N+1's result, whatever
it says, is dropped; the Worker fails a step whose pending token it lacks, spoiling what
it would write, as a failed step does.

:class:`StepsInFlight` keeps the steps and marks each sequence's ``sampled_by`` and
``pending_in`` (:class:`ringfence.sched.sequence.Sequence`); the scheduler does the rest.
Owned by one scheduler; not thread-safe; pure.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from ringfence.sched.ops import StepOp
from ringfence.sched.sequence import Sequence


class StepsInFlight:
    """The steps issued, results not applied yet, oldest first (``limit`` of them at most),
    and those a failed step before them voided."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._steps: deque[StepOp] = deque()
        self._void: set[int] = set()

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def oldest(self) -> StepOp | None:
        return self._steps[0] if self._steps else None

    @property
    def room(self) -> bool:
        """Whether another step may be issued."""
        return len(self._steps) < self.limit

    @property
    def behind(self) -> int:
        """The newest step in flight, whose tokens a step issued now may take (0: none)."""
        return self._steps[-1].step if self._steps else 0

    def busy(self) -> frozenset[int]:
        """The sequences of the steps in flight (never preempted for the next one)."""
        return frozenset(p.seq_id for op in self._steps for p in op.pieces)

    def issued(self, op: StepOp, seqs: Mapping[int, Sequence]) -> None:
        """Step ``op`` was issued: each sequence whose piece samples is ``sampled_by`` it,
        and one whose piece takes a pending token has its decode ``pending_in`` it."""
        self._steps.append(op)
        for piece in op.pieces:
            seq = seqs[piece.seq_id]
            if piece.pending_from:
                seq.pending_in = op.step
            elif piece.sample:
                seq.sampled_by = op.step

    def applied(self, step: int) -> StepOp | None:
        """The oldest step, whose result comes now; None where it is void (its result is
        dropped). RuntimeError if ``step`` is not the oldest in flight."""
        op = self.oldest
        if op is None or op.step != step:
            raise RuntimeError(f"result of step {step}, but the oldest step in flight is {op}")
        self._steps.popleft()
        if step in self._void:
            self._void.discard(step)
            return None
        return op

    def void_rest(self) -> list[StepOp]:
        """A step failed: every step still in flight is void (its result will be dropped,
        whatever it says). Returns them, for their sequences to be computed again."""
        self._void.update(op.step for op in self._steps)
        return list(self._steps)

    def clear(self) -> None:
        """The device tier was reset: no result of a step in flight will be applied."""
        self._steps.clear()
        self._void.clear()


def follows(seq: Sequence, behind: int) -> bool:
    """Whether the sequence gets a decode of the token step ``behind`` (in flight) samples
    for it: one more is wanted after that token, and no grammar waits for it."""
    r = seq.request
    return (
        behind > 0
        and seq.sampled_by == behind
        and not seq.pending_in
        and r.num_output_tokens + 1 < r.params.max_tokens
        and r.params.structured is None
    )


def check_tokens(op: StepOp, seqs: Mapping[int, Sequence]) -> None:
    """RuntimeError if step ``op``'s result, applied, left a sequence without the token
    that its decode in the next step takes (the Worker samples every piece that asks)."""
    for piece in op.pieces:
        seq = seqs.get(piece.seq_id)
        if seq is not None and seq.pending_in and seq.sampled_by == op.step:
            raise RuntimeError(
                f"step {op.step}'s result has no token for sequence {seq.seq_id}, whose "
                f"decode in step {seq.pending_in} takes it"
            )

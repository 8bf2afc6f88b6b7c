"""The tokens the Worker sampled in its last step, for the decodes planned before they were
known (``sched.steps_in_flight = 2``; ``Piece.pending_from``).

The engine plans step N+1 while step N runs, so a decode of N+1 may name "the token step
N sampled for this sequence" instead of a token. The Worker runs its steps in lane order
and keeps the tokens of the one it ran last (by sequence id); once the plan's fence is
reached it puts them in. A plan naming another step, or a sequence that step sampled
nothing for (it failed, was rejected or cancelled, or the Worker restarted since), cannot
run: :class:`MissingToken` makes it fail as a step that raises does, its error naming
what was missing, and so it spoils the blocks it would have written. Not a rejection
that touches nothing: a swap-out or write-back fenced on it, issued before the engine
learned that step N failed, would otherwise copy the blocks' older KV as this step's and
store it under this step's keys (the model checker's ``MUT_PENDING_UNSPOILED``). The
scheduler, which learned that step N did not come back ``ok``, has already voided N+1
(sched/scheduler.py).

On a GPU the point of two in flight is to queue N+1's kernels before N's tokens reach the
host, so that the device never waits for the host between them (``model.launch_ahead``,
``worker.py``). Such a launch takes its inputs where N's draw left them, on the device
(:func:`on_device`: an index into N's sampled ids, gathered there), and the Worker reads N's
tokens back afterwards, waiting for N's kernels alone. If N then fails, so does N+1, which
ran on what N computed: its writes spoiled, as here.

Owned by the Worker's actor thread; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import fields, replace
from typing import TYPE_CHECKING

import torch

from ringfence.actors.model.host import to_device
from ringfence.actors.model.inputs import DeviceInputs
from ringfence.sched.ops import Piece, StepOp
from ringfence.shm.errors import RingfenceError

if TYPE_CHECKING:
    from ringfence.actors.executors.sampling import Draw

# A piece with its token put in is built slot by slot, not by dataclasses.replace: that
# costs 4.9 us a piece (fields() and __init__ on every call), this 1.9 us, and at 256
# decodes a step the difference is 0.8 ms of host time that the device waits through.
# It copies every other field, so a field added to Piece is copied too; a __post_init__
# would be skipped, so Piece must not have one.
_COPIED: tuple[tuple[Callable[[object, object], None], Callable[[object], object]], ...] = tuple(
    (getattr(Piece, f.name).__set__, getattr(Piece, f.name).__get__)
    for f in fields(Piece)
    if f.name not in ("token_ids", "pending_from")
)
_SET_TOKENS = getattr(Piece, "token_ids").__set__  # noqa: B009 (a slot: mypy sees a field)
_SET_PENDING = getattr(Piece, "pending_from").__set__  # noqa: B009
if hasattr(Piece, "__post_init__"):
    raise TypeError("Piece has a __post_init__, which with_token would skip")


def with_token(piece: Piece, token: int) -> Piece:
    """``piece`` taking ``token`` as its one input, no longer pending."""
    made = object.__new__(Piece)
    for store, load in _COPIED:
        store(made, load(piece))
    _SET_TOKENS(made, (token,))
    _SET_PENDING(made, 0)
    return made


class MissingToken(RingfenceError, LookupError):
    """A plan takes a token the Worker did not sample in the last step it ran."""


class SampledTokens:
    """The last step run and the token it sampled for each sequence (empty if it failed)."""

    def __init__(self) -> None:
        self._step = 0
        self._tokens: dict[int, int] = {}

    def keep(self, step: int, sampled: Iterable[tuple[int, int]]) -> None:
        """Step ``step`` ended with these (seq_id, token_id); nothing when it was not ok."""
        self._step, self._tokens = step, dict(sampled)

    def resolve(self, plan: StepOp) -> StepOp:
        """The plan with each pending input replaced by its token; MissingToken naming the
        sequence and the step if one is not here."""
        if not any(p.pending_from for p in plan.pieces):
            return plan
        pieces = []
        for p in plan.pieces:
            if not p.pending_from:
                pieces.append(p)
                continue
            if p.pending_from != self._step:
                raise MissingToken(
                    f"sequence {p.seq_id} takes the token step {p.pending_from} sampled, "
                    f"but the last step this Worker ran is {self._step}"
                )
            token = self._tokens.get(p.seq_id)
            if token is None:
                raise MissingToken(
                    f"sequence {p.seq_id} takes the token step {p.pending_from} sampled, "
                    "which sampled none for it (the step did not come back ok)"
                )
            pieces.append(with_token(p, token))
        return replace(plan, pieces=tuple(pieces))


def on_device(plan: StepOp, step: int, draw: Draw | None) -> DeviceInputs | None:
    """The plan's pending inputs gathered from ``draw``, step ``step``'s (queued, perhaps
    not run yet): one small copy of row ids and one gather, queued, never waited for. None
    where a pending piece names another step or a sequence the draw has no row of (the
    plan then waits for its turn, where :meth:`SampledTokens.resolve` names what it lacks),
    and where the plan has no pending piece."""
    chosen = [i for i, p in enumerate(plan.pieces) if p.pending_from]
    if not chosen or draw is None:
        return None
    rows = {draw.pieces[r].seq_id: j for j, r in enumerate(draw.rows)}
    found = []
    for i in chosen:
        piece = plan.pieces[i]
        row = rows.get(piece.seq_id)
        if piece.pending_from != step or row is None:
            return None
        found.append(row)
    index = to_device(torch.tensor(found, dtype=torch.long), draw.out.device)
    # The draw's first rows are its tokens, as float64 (exact below 2**53).
    ids = draw.out.index_select(0, index).to(torch.int64)
    return DeviceInputs(tuple(chosen), ids)

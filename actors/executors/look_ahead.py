"""The Worker's look-ahead: the next step's plan checked while this step runs on the device.

With two steps in flight (``sched.steps_in_flight = 2``) the engine's next plan is usually in
the Worker's ring before the step it follows is done. On a GPU that step runs beside the
host: the Worker has queued its kernels and waits for its tokens. The host's check of the
next plan (``actors/model/step_check.py``: a millisecond of Python at 256 sequences) would
otherwise run after the step is reported, while the device waits for the next one.

So, once a step's kernels are queued, :meth:`CheckAhead.check_next` reads the next frame
from the engine ahead (``Actor.peek``: it is decoded now, handed to its handler next as
usual, and released only after that handler ran) and, if it is a plan, runs the step check
on it and keeps the verdict. When that plan's turn comes, :meth:`CheckAhead.verdict` gives
the kept verdict in place of the check, at the same point of the Worker's checks, so the
order in which a bad plan's problems are named is unchanged.

The check's verdict depends on the plan and the pool alone: the tables the checker keeps
are facts about tuples of ids (``step_check.py``), so no step run, sequence ended or table
forgotten in between can change it. Everything else the Worker decides about a plan (its
order, its epoch, its fence, the sampler's sequences, the poison ids) is still decided when
its turn comes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ringfence.sched.ops import Piece, StepOp


class CheckAhead:
    """The step check of the plan read ahead, kept until that plan's turn. Owned by the
    Worker's thread."""

    __slots__ = ("_check", "_peek", "_plan", "_verdict", "checked", "taken")

    def __init__(
        self, peek: Callable[[], object | None], check: Callable[[Sequence[Piece]], None]
    ) -> None:
        self._peek = peek  # the next message from the engine, read ahead (or None)
        self._check = check  # the step check: raises ValueError naming what is wrong
        self._plan: StepOp | None = None
        self._verdict = ""
        self.checked = 0  # plans checked ahead
        self.taken: int | None = None  # the step of the last verdict given from ahead

    def check_next(self) -> None:
        """Check the next plan now if it has arrived (once: it may be peeked again)."""
        plan = self._peek()
        if not isinstance(plan, StepOp) or not plan.pieces or plan is self._plan:
            return
        try:
            self._check(plan.pieces)
            verdict = ""
        except ValueError as e:
            verdict = str(e)
        self._plan, self._verdict = plan, verdict
        self.checked += 1

    def verdict(self, plan: StepOp) -> str | None:
        """The verdict of ``plan`` if it was checked ahead ("" when it passed), else None
        (then the caller checks it); given once."""
        if plan is not self._plan:
            return None
        self._plan, self.taken = None, plan.step
        return self._verdict

"""The Worker's look-ahead: the next step's plan checked while this step runs on the device.

With two steps in flight (``sched.steps_in_flight = 2``) the engine's next plan is usually in
the Worker's ring before the step it follows is done. On a GPU that step runs beside the
host: the Worker has queued its kernels and waits for its tokens. The host's check of the
next plan (``actors/model/step_check.py``: a millisecond of Python at 256 sequences) would
otherwise run after the step is reported, while the device waits for the next one.

So, once a step's kernels are queued (its forward and its sampling),
:meth:`CheckAhead.check_next` reads the next frame from the engine ahead (``Actor.peek``: it
is decoded now, handed to its handler next as usual, and released only after that handler
ran) and, if it is a plan, runs the step check on it and keeps the verdict. The frame is
often not there yet when the kernels are queued: the engine's turn (about 0.75 ms on an
H200's host) outlasts the queuing. So on CUDA the Worker waits for it, sleeping on its own
doorbell, until the device has finished the step: the engine's frame rings that doorbell,
and so does :class:`DeviceWatch`, a thread that waits for the step's CUDA event. Whichever
comes first ends the wait; the device never waits for the look-ahead.

When that plan's turn comes, :meth:`CheckAhead.verdict` gives the kept verdict in place of
the check, at the same point of the Worker's checks, so the order in which a bad plan's
problems are named is unchanged.

The check's verdict depends on the plan and the pool alone: the tables the checker keeps
are facts about tuples of ids (``step_check.py``), so no step run, sequence ended or table
forgotten in between can change it. Everything else the Worker decides about a plan (its
order, its epoch, its fence, the sampler's sequences, the poison ids) is still decided when
its turn comes.
"""

from __future__ import annotations

import collections
import contextlib
import queue
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import torch

from ringfence.sched.ops import Piece, StepOp
from ringfence.shm.counter import Waker

_IDLE_WAKE_S = 30.0  # the watch thread's wait for work has a deadline; waking idle is free


class WorkAhead(NamedTuple):
    """What a Worker does ahead of a step's turn (``model.look_ahead``, ``launch_ahead``)."""

    check: bool  # check the next plan while a step runs (CheckAhead)
    launch: bool  # queue its kernels before the step before is reported (worker.py)
    early: bool  # ... while that step lands, on its tokens on the device; else once read


def choose_ahead(look: str, launch: str, cuda: bool, alone: bool) -> WorkAhead:
    """The settings resolved: "auto" is on for a CUDA device, whose steps run beside the
    host; launching needs the check, and one rank not under the lock (``alone``)."""
    forced = launch in ("on", "late")
    check = look == "on" or (look == "auto" and (cuda or forced))
    launches = check and alone and (forced or (launch == "auto" and cuda))
    return WorkAhead(check, launches, launches and launch != "late")


class Completion(Protocol):
    """What the watch waits for: a ``torch.cuda.Event`` recorded after a step's kernels."""

    def synchronize(self) -> None: ...


class CheckAhead:
    """The step check of the plan read ahead, kept until that plan's turn. Owned by the
    Worker's thread."""

    __slots__ = ("_check", "_given", "_peek", "_plan", "_verdict", "_wait", "checked", "taken")

    def __init__(
        self,
        peek: Callable[[], object | None],
        check: Callable[[Sequence[Piece]], None],
        wait: Callable[[Callable[[], bool]], bool] | None = None,
    ) -> None:
        self._peek = peek  # the next message from the engine, read ahead (or None)
        self._check = check  # the step check: raises ValueError naming what is wrong
        # Sleeps on the actor's doorbell until the condition holds (False at its deadline).
        self._wait = wait
        self._plan: StepOp | None = None
        self._verdict = ""
        self.checked = 0  # plans checked ahead
        self.taken: int | None = None  # the step of the last verdict given from ahead
        self._given: collections.deque[int] = collections.deque(maxlen=4)  # the last few

    def check_next(self, done: Callable[[], bool] | None = None) -> None:
        """Check the next plan if it has arrived (once: it may be peeked again). Given
        ``done`` (true once the device has finished the step that runs), first wait for the
        next message until then."""
        if done is not None and self._wait is not None:
            self._wait(lambda: self._peek() is not None or done())
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

    def passed(self) -> StepOp | None:
        """The plan read ahead whose check passed, not yet given (its verdict still is)."""
        return self._plan if self._plan is not None and not self._verdict else None

    def verdict(self, plan: StepOp) -> str | None:
        """The verdict of ``plan`` if it was checked ahead ("" when it passed), else None
        (then the caller checks it); given once."""
        if plan is not self._plan:
            return None
        self._plan, self.taken = None, plan.step
        self._given.append(plan.step)
        return self._verdict

    def given(self, step: int) -> bool:
        """Whether step ``step``'s verdict was given from ahead (one of the last few: a step
        launched while the one before lands takes its verdict before that one ends)."""
        return step in self._given


class DeviceWatch:
    """A thread that rings an actor's doorbell when the device work it is given completes,
    so that the actor can sleep on its doorbell for a frame and the device at once (one
    per Worker on CUDA; its thread alone calls ``synchronize``)."""

    def __init__(self, bell: Waker) -> None:
        self._bell = bell
        self._jobs: queue.SimpleQueue[tuple[Completion, threading.Event] | None] = (
            queue.SimpleQueue()
        )
        name = "ringfence-device-watch"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def watch(self, completion: Completion) -> Callable[[], bool]:
        """Ring the doorbell once ``completion`` is reached; returns whether it is yet."""
        reached = threading.Event()
        self._jobs.put((completion, reached))
        return reached.is_set

    def queued(self, device: torch.device) -> Callable[[], bool]:
        """:meth:`watch` the work queued so far on ``device``'s current CUDA stream."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        return self.watch(event)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread after the work it was given (its last wait is the device's)."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_IDLE_WAKE_S)
            except queue.Empty:
                continue
            if job is None:
                return
            completion, reached = job
            # The device's own wait: it has no deadline to give. An error is the device's,
            # which the actor's own wait for the same work raises.
            with contextlib.suppress(Exception):
                completion.synchronize()
            reached.set()
            self._bell.ring()

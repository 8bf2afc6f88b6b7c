"""The engine's issuing ledger: ops waiting for credit, ops in flight, completions counted.

Per lane, the scheduler's ops wait here in issue order until the lane has credit; then each
goes, stamped with the epoch it was issued in, to the lane's executor of every rank
(docs/design.md, "Ranks (tensor parallelism)"). Per (lane, rank) the ledger knows the last
op completed, and per lane the last op sent: ops in flight at a rank are their difference,
so a completion that a restarted executor repeats never frees a credit twice. An op is
complete once every rank has reported it, each rank counted once; only then is its outcome
handed to the scheduler: ``ok`` only if every rank's was, a prefetch's missing blocks the
union of every rank's, and the sampled tokens of rank 0's step result.

In ``transfer.mode = "sync"`` an op is also held until every op its fence names is
complete, and then sent with no fence: the legacy ordering, measured against the fences.

Owned by the Engine actor; sends through the function it is given, logs through its log.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from ringfence.actors.protocol.transfer import OpDone
from ringfence.actors.protocol.worker import PromptLogprobs, Sampled, StepResult
from ringfence.cache.fences import NO_WAIT, Access, Lane
from ringfence.runtime.log import ActorLog
from ringfence.sched.ops import Op, StepOp, SwapOp

# Ops in flight per lane and rank; the step lane's is sched.steps_in_flight (Ledger).
CREDITS = {Lane.STEP: 1, Lane.SWAP: 8, Lane.STORE: 8}
TARGET = {Lane.STEP: "worker", Lane.SWAP: "swap", Lane.STORE: "store"}
LANE_OF = {"swap": Lane.SWAP, "store": Lane.STORE}
_WORST = ("ok", "cancelled", "failed", "rejected")  # the status of an op whose ranks differ

Report = StepResult | OpDone
SendAll = Callable[[str, list[object]], object]  # (role, messages): to every rank, in order


class Outcome(NamedTuple):
    """A complete op, as the scheduler is to apply it."""

    lane: Lane
    number: int
    status: str  # "ok" only if every rank's was
    error: str  # the first rank's error that is not empty
    missing: tuple[int, ...]  # a prefetch: positions any rank lacks
    sampled: Sampled  # a step: rank 0's sampled tokens
    bytes: int  # summed over ranks
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # a step: rank 0's, when asked


@dataclass(slots=True)
class _Lane:
    """One lane's ops: waiting for credit (each with its issue epoch), sent, reported."""

    queue: deque[tuple[Op, int]] = field(default_factory=deque)
    last_sent: int = 0
    completed: dict[int, int] = field(default_factory=dict)  # rank -> last op completed there
    sent_epoch: dict[int, int] = field(default_factory=dict)  # op -> epoch, until complete
    reports: dict[int, dict[int, Report]] = field(default_factory=dict)  # op -> rank -> report

    def complete(self) -> int:
        """The last op every rank has completed."""
        return min(self.completed.values())


class Ledger:
    """See the module docstring. ``ranks``: the executors of each lane; ``step_credits``:
    steps in flight (``sched.steps_in_flight``; the scheduler plans no more than that)."""

    def __init__(
        self, ranks: int, *, sync: bool, send_all: SendAll, log: ActorLog, step_credits: int = 1
    ) -> None:
        self.ranks, self.sync, self.send_all, self.log = ranks, sync, send_all, log
        self.credits = CREDITS | {Lane.STEP: step_credits}
        self.lanes = {lane: _Lane(completed=dict.fromkeys(range(ranks), 0)) for lane in Lane}
        self.first = dict.fromkeys(Lane, 1)  # each lane's first op number (see begin)
        # The scheduler's declared sets of an op, for op.issue (the engine sets it when tracing).
        self.access_of: Callable[[Op], Access | None] | None = None

    def begin(self, first: Mapping[Lane, int]) -> None:
        """Number each lane's ops from ``first`` on: every op before it is complete."""
        self.first |= first
        for lane, number in first.items():
            state = self.lanes[lane]
            state.last_sent = number - 1
            state.completed = dict.fromkeys(range(self.ranks), number - 1)

    def queue(self, ops: Iterable[Op], epoch: int) -> None:
        """Ops the scheduler issued (in issue order), stamped with ``epoch`` when sent."""
        for op in ops:
            self.lanes[op.lane].queue.append((op, epoch))

    def waiting(self) -> bool:
        """Whether an op still waits for credit."""
        return any(state.queue for state in self.lanes.values())

    def last_sent(self, lane: Lane) -> int:
        return self.lanes[lane].last_sent

    def completed(self, lane: Lane) -> int:
        """The last op of ``lane`` complete on every rank."""
        return self.lanes[lane].complete()

    def num_completed(self, lane: Lane) -> int:
        """Ops of ``lane`` this ledger numbered that are complete on every rank."""
        return self.completed(lane) - self.first[lane] + 1

    def in_flight(self, lane: Lane) -> int:
        """Ops sent to ``lane`` that some rank has not completed."""
        state = self.lanes[lane]
        return state.last_sent - state.complete()

    def pump(self) -> None:
        """Send, in issue order, every op whose lane has credit at every rank (and, in sync
        mode, whose fence's ops are all complete)."""
        for lane, state in self.lanes.items():
            batch: list[object] = []  # one put_many a rank: the lane's executor wakes once
            while state.queue and self.in_flight(lane) < self.credits[lane]:
                op, epoch = state.queue[0]
                sent = op
                if self.sync:
                    waits = op.fence.waits()
                    if any(self.completed(other) < n for other, n in waits.items()):
                        break
                    sent = replace(op, fence=NO_WAIT)
                state.queue.popleft()
                state.last_sent = op.number
                state.sent_epoch[op.number] = epoch
                batch.append(replace(sent, epoch=epoch))
                if self.log.tracing:
                    self._trace_issue(op)
            if batch:
                self.send_all(TARGET[lane], batch)

    def settle(self, lane: Lane, rank: int, report: Report, epoch_now: int) -> Outcome | None:
        """Count one rank's report of an op; the op's outcome once it is complete on every
        rank and of the engine's current epoch ``epoch_now``, else None.

        Not counted: a repeat (a restarted executor resends a report that may have come),
        a report of an op never sent, or one stamped with another epoch than the op was
        sent with (no executor sends that). Counted but not applied: an op of an older
        epoch (the scheduler already took it as lost in a reset). Each is logged.
        """
        number, epoch = _number(report), report.epoch
        state = self.lanes[lane]
        why = ""
        if not 0 <= rank < self.ranks:
            why = f"from rank {rank}; the lane has {self.ranks}"
        elif number <= state.completed[rank]:
            why = f"a repeat: {lane} is complete up to {state.completed[rank]} at rank {rank}"
        elif number > state.last_sent:
            why = f"never sent: the last {lane} op sent is {state.last_sent}"
        elif state.sent_epoch.get(number, epoch) != epoch:
            why = f"the op was sent with epoch {state.sent_epoch[number]}, not {epoch}"
        if why:
            self._stale(lane, number, epoch, why)
            return None
        state.reports.setdefault(number, {})[rank] = report
        before = state.complete()
        self.complete_up_to(lane, rank, number)
        if state.complete() < number:
            return None  # another rank is still to report it
        outcome = _combine(lane, number, state.reports.pop(number, {}))
        for done in range(before + 1, number):  # completed on every rank with this one
            state.reports.pop(done, None)
        if epoch == epoch_now:
            return outcome
        self._stale(lane, number, epoch, f"of epoch {epoch}, the engine's is {epoch_now}")
        return None

    def complete_up_to(self, lane: Lane, rank: int, number: int) -> None:
        """Every op of ``lane`` up to ``number`` is complete at ``rank`` (its executor's
        watermark says so): forget the sent epochs of those complete everywhere."""
        state = self.lanes[lane]
        before = state.complete()
        state.completed[rank] = max(state.completed[rank], number)
        for done in range(before + 1, state.complete() + 1):
            state.sent_epoch.pop(done, None)

    def _stale(self, lane: Lane, number: int, epoch: int, why: str) -> None:
        self.log.warning("engine.stale", lane=str(lane), op=number, msg_epoch=epoch, why=why)

    def _trace_issue(self, op: Op) -> None:
        """``op.issue`` with the scheduler's fence (in sync mode the message's is empty: the
        engine waited for those ops itself), every block the op touches, and the sets it
        declared to the fence tracker (``declared``, when the engine gave ``access_of``)."""
        f = issue_fields(op)  # a step's fields or a transfer's; the others are None
        access = None if self.access_of is None else self.access_of(op)
        self.log.trace(
            "op.issue",
            lane=str(op.lane),
            op=op.number,
            fence=f["fence"],
            sync=self.sync,
            pieces=f.get("pieces"),
            poison=f.get("poison"),
            direction=f.get("direction"),
            reason=f.get("reason"),
            device_blocks=f.get("device_blocks"),
            host_blocks=f.get("host_blocks"),
            declared=None if access is None else access_fields(access),
        )


def access_fields(access: Access) -> dict[str, dict[str, list[int]]]:
    """Declared sets as ``op.issue`` logs them and ``op.touched`` mirrors them:
    {"reads": {tier: blocks}, "writes": {tier: blocks}}, tiers without blocks left out."""
    reads = {"device": access.read_device, "host": access.read_host}
    writes = {"device": access.write_device, "host": access.write_host}
    return {
        "reads": {tier: list(b) for tier, b in reads.items() if b},
        "writes": {tier: list(b) for tier, b in writes.items() if b},
    }


def issue_fields(op: Op) -> dict[str, Any]:
    """What ``op.issue`` logs of an op, as JSON values: the scheduler's fence and every block
    it touches (a step's pieces as [seq_id, start, tokens, sample, block_table])."""
    fence = {str(lane): n for lane, n in op.fence.waits().items()}
    if isinstance(op, StepOp):
        pieces = [
            [p.seq_id, p.start, len(p.token_ids), p.sample, list(p.block_table)] for p in op.pieces
        ]
        return {"fence": fence, "pieces": pieces, "poison": list(op.poison)}
    return {
        "fence": fence,
        "direction": op.direction,
        "reason": op.reason,
        "device_blocks": list(op.device_blocks) if isinstance(op, SwapOp) else [],
        "host_blocks": list(op.host_blocks),
    }


def _number(report: Report) -> int:
    return report.step if isinstance(report, StepResult) else report.op


def _combine(lane: Lane, number: int, reports: Mapping[int, Report]) -> Outcome:
    """One outcome of every rank's report of an op (see the module docstring)."""
    ranked = [reports[rank] for rank in sorted(reports)]
    statuses = {r.status for r in ranked}
    status = max(statuses, key=_WORST.index) if statuses else "failed"
    first = ranked[0] if ranked else None
    missing: set[int] = set()
    moved = 0
    for r in ranked:
        if isinstance(r, OpDone):
            missing.update(r.missing)
            moved += r.bytes
    sampled = first.sampled if isinstance(first, StepResult) and 0 in reports else Sampled()
    error = next((r.error for r in ranked if r.error), "")
    if status == "ok" and (problem := sampled.problem()):  # a result it cannot read
        status, error, sampled = "failed", f"rank 0's result: {problem}", Sampled()
    return Outcome(
        lane=lane,
        number=number,
        status=status,
        error=error,
        missing=tuple(sorted(missing)),
        sampled=sampled,
        bytes=moved,
        prompt_logprobs=(
            first.prompt_logprobs if isinstance(first, StepResult) and 0 in reports else ()
        ),
    )

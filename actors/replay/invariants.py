"""I1-I4 from the logs: an independent per-block record of each lane's readers and writers.

Walking the ops in the scheduler's issue order, the record of the last writer and the
last user of each device and host block in each lane gives, for every op and every other
lane, the latest earlier op it conflicts with (at least one of the two writes the block).
The op must have *seen* that op's lane watermark at or past it before it touched a block
(``seen_*`` of its completion: else the violation really happened), and its fence must
name it (else the run was lucky: the scheduler's fence is too weak). See ``checks.py``.

With several ranks (docs/design.md, "Ranks (tensor parallelism)") every rank runs every op
on its own shard, and rank r's executor waits only on rank r's watermarks: the op's
completion at rank r (its ``seen_*``, logged by rank r's executor) must show rank r's lanes
past the conflicting op. One rank's completion never vouches for another's. The fence is the
engine's, one for every rank, so a fence too weak is one finding, not one per rank.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

from ringfence.actors.replay.findings import TOUCHED, CheckResult, Violation, entries_of, op_name
from ringfence.actors.replay.records import Entry, Op, RunLog


class Conflict(NamedTuple):
    """The latest earlier op of another lane that an op must come after, and on what."""

    other: Op
    tier: str  # "device" or "host"
    block: int
    after_write: bool  # the op reads what ``other`` wrote (else it overwrites what it used)


def check_invariants(log: RunLog, result: CheckResult) -> None:
    """I1-I4 from an independent per-block record of readers and writers per lane."""
    size = log.block_size
    writer: dict[tuple[str, int], dict[str, Op]] = defaultdict(dict)
    user: dict[tuple[str, int], dict[str, Op]] = defaultdict(dict)
    ready = {e.life: e for e in log.events("engine.ready")}
    issuer: tuple[int, int] | None = None
    last: dict[str, Op] = {}  # per lane, the last op issued (by any engine)
    for key in log.issue_order:
        op = log.ops.get(key)
        if op is None or op.issue is None:
            continue
        if op.issue.life != issuer:
            # A new engine began only once every executor had handled every op before
            # (its Resync answers: engine.ready's first_ops); nothing it issues can
            # conflict with those, so the record starts again. Check that it did.
            issuer = op.issue.life
            _resynced(ready.get(issuer), last, result)
            writer.clear()
            user.clear()
        last[op.lane] = op
        result.counts["I1-I4 ops"] += 1
        reads, writes = op.access(size)
        need: dict[str, Conflict] = {}  # per other lane
        for tier, blocks in reads.items():
            for block in blocks:
                _latest(need, writer[(tier, block)], op, tier, block, after_write=True)
        for tier, blocks in writes.items():
            for block in blocks:
                _latest(need, user[(tier, block)], op, tier, block, after_write=False)
        for tier, blocks in reads.items():
            for block in blocks:
                user[(tier, block)][op.lane] = op
        for tier, blocks in writes.items():
            for block in blocks:
                writer[(tier, block)][op.lane] = op
                user[(tier, block)][op.lane] = op
        for lane, conflict in sorted(need.items()):
            _judge(op, lane, conflict, result)


def _resynced(ready: Entry | None, last: dict[str, Op], result: CheckResult) -> None:
    """An engine's first ops come after every op an engine before it issued, lane by lane."""
    first = (ready.get("first_ops") if ready is not None else None) or {}
    for lane, op in last.items():
        if int(first.get(lane, 1)) <= op.number:
            causes = entries_of(ready, op.issue)
            result.violations.append(
                Violation(
                    "ops",
                    f"an engine began with {lane} op {first.get(lane, 1)}, but an engine before "
                    f"it had issued {op_name(op)}",
                    causes,
                )
            )


def _latest(
    need: dict[str, Conflict],
    previous: dict[str, Op],
    op: Op,
    tier: str,
    block: int,
    *,
    after_write: bool,
) -> None:
    for lane, other in previous.items():
        if lane != op.lane and (lane not in need or need[lane].other.number < other.number):
            need[lane] = Conflict(other, tier, block, after_write)


def _invariant(op: Op, conflict: Conflict) -> str:
    if conflict.tier == "host":
        return "I4"
    if conflict.after_write:
        return "I1" if op.lane == "step" else "I2"
    return "I3"


def _judge(op: Op, lane: str, conflict: Conflict, result: CheckResult) -> None:
    other, tier, block = conflict.other, conflict.tier, conflict.block
    invariant = _invariant(op, conflict)
    what = "read" if conflict.after_write else "overwrote"
    since = "wrote" if conflict.after_write else "used"
    first = op.first_done()
    broken = False
    for rank, done in first.items():
        seen = op.seen(lane, rank)
        if op.status_at(rank) not in TOUCHED or seen is None or seen >= other.number:
            continue
        broken = True
        before = other.first_done().get(rank)
        result.violations.append(
            Violation(
                invariant,
                f"{done.source}: {op_name(op)} {what} {tier} block {block} having seen "
                f"{lane}_done at {seen}, before {op_name(other)} (which {since} it) was done",
                entries_of(done, op.issue, other.issue, before),
            )
        )
    if not broken and op.fence(lane) < other.number:
        result.violations.append(
            Violation(
                invariant,
                f"{op_name(op)}'s fence waits for {lane} {op.fence(lane)}, but "
                f"{op_name(other)} {since} {tier} block {block} it {what} (fence too weak"
                f"{'; this run was lucky' if first else ''})",
                entries_of(op.issue, other.issue, *first.values()),
            )
        )

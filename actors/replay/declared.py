"""Check ``declared``: every block an executor touched was declared to the fence tracker.

The fence of an op is computed from the block sets the scheduler gives the tracker
(``op.issue``'s ``declared``); the executors touch blocks by the op's own fields (a
step's block tables, a swap's block lists), and at trace level each logs the blocks it
actually indexed (``op.touched``, see ``actors/executors/touches.py``). A block touched
but not declared is one the fence ignored: a read missing from the declared reads and
writes waits for no writer of another lane, a write missing from the declared writes
waits for no reader. That holds whether or not the run happened to hit a conflicting op,
so this check fails a scheduler that under-reports on any real run, where I1-I4 (which
derive the blocks from the op's fields) need the conflict to occur. Declaring more than
is touched is allowed (it costs waiting, never a wrong token) and counted.

With several ranks every rank's ``op.touched`` is checked on its own. Logs of an engine
without ``declared`` (older runs) are skipped and counted.
"""

from __future__ import annotations

from typing import Any

from ringfence.actors.replay.findings import CheckResult, Violation, entries_of, op_name
from ringfence.actors.replay.records import Entry, Op, RunLog

TIERS = ("device", "host")
SHOWN = 8  # block ids named in a finding


def check_declared(log: RunLog, result: CheckResult) -> None:
    """See the module docstring."""
    for key in log.issue_order:
        op = log.ops.get(key)
        if op is None or op.issue is None or not op.touched:
            continue
        declared = op.issue.get("declared")
        if declared is None:
            result.counts["declared: ops without declared sets"] += 1
            continue
        result.counts["declared ops"] += 1
        reads, writes = _sets(declared.get("reads")), _sets(declared.get("writes"))
        for touched in op.touched:
            _judge(op, touched, reads, writes, result)


def _judge(
    op: Op,
    touched: Entry,
    reads: dict[str, set[int]],
    writes: dict[str, set[int]],
    result: CheckResult,
) -> None:
    did_read, did_write = _sets(touched.get("reads")), _sets(touched.get("writes"))
    for tier in TIERS:
        for verb, blocks, allowed, kind in (
            ("read", did_read[tier], reads[tier] | writes[tier], "reads or writes"),
            ("wrote", did_write[tier], writes[tier], "writes"),
        ):
            extra = sorted(blocks - allowed)
            if extra:
                shown = ", ".join(map(str, extra[:SHOWN])) + (" ..." if len(extra) > SHOWN else "")
                result.violations.append(
                    Violation(
                        "declared",
                        f"{touched.source}: {op_name(op)} {verb} {tier} blocks {shown} that it "
                        f"did not declare among its {kind} (declared {sorted(allowed)[:SHOWN]}): "
                        "its fence ignores them",
                        entries_of(touched, op.issue),
                    )
                )
        if (did_read[tier] | did_write[tier]) < (reads[tier] | writes[tier]):
            result.counts["declared: ops declaring more than they touched"] += 1


def _sets(field: Any) -> dict[str, set[int]]:
    """{tier: blocks} of a logged field, every tier present."""
    given = field if isinstance(field, dict) else {}
    return {tier: {int(b) for b in given.get(tier) or ()} for tier in TIERS}

"""Check ``ops`` of ``ringfence replay``: every issued op completed at every rank and was
applied as its ranks reported it.

Every issued op completed (ok, failed, rejected or cancelled) at every rank, or is
reported as still in flight at the end of the log where no later op of its lane
completed at that rank (an engine that died, or one killed with an issue line still
buffered, leaves its ops in flight, not in violation, and so does an executor killed
between completing an op and its report reaching the engine); nothing was executed that the
engine never issued, nor issued twice; the engine applied an op only once every rank had
completed it, after it received every rank's report (where the ring messages were
logged), with the status the ranks reported (the worst of them), or dropped it as stale.
"""

from __future__ import annotations

from collections import Counter

from ringfence.actors.replay.findings import CheckResult, Violation, entries_of, op_name
from ringfence.actors.replay.records import (
    DONE_EVENTS,
    LANE_ACTORS,
    LANE_NAMES,
    Entry,
    Op,
    RunLog,
)


def check_ops(log: RunLog, result: CheckResult) -> None:
    """See the module docstring."""
    last_done: Counter[tuple[str, int]] = Counter()  # (lane, rank) -> its last op completed
    for op in log.ops.values():
        for done in op.done:
            key = (op.lane, done.rank)
            last_done[key] = max(last_done[key], op.number)
    killed = _killed_engines(log)
    dead = _dead_engines(log)
    dead_executors = _dead_executors(log)
    receipts = _report_receipts(log) if log.traced else None
    for op in sorted(log.ops.values(), key=lambda o: (o.lane, o.number)):
        name = op_name(op)
        result.counts["ops"] += 1
        for extra in op.extra_issues:
            result.violations.append(
                Violation("ops", f"{name} issued twice", (extra, *entries_of(op.issue)))
            )
        if log.traced and op.issue is None and op.done:
            issuer = killed.get((op.lane, op.number))
            if issuer is not None:  # its op.issue was still buffered when the engine died
                result.in_flight.append(
                    f"{name} (executed; issued by engine pid {issuer[0]}, killed)"
                )
            else:
                result.violations.append(
                    Violation("ops", f"{name} was executed but never issued", (op.done[0],))
                )
        if not _every_rank_done(log, op, last_done, result) or not log.traced:
            continue
        status = op.status
        if op.applied:
            got = op.applied[0].get("status")
            if got != status:
                result.violations.append(
                    Violation(
                        "ops",
                        f"the engine applied {name} as {got}; its executors reported {status}",
                        (op.applied[0], *op.first_done().values()),
                    )
                )
            if len(op.applied) > 1:
                result.violations.append(
                    Violation("ops", f"the engine applied {name} twice", tuple(op.applied))
                )
            _applied_after_reports(op, receipts, result)
        elif not op.stale:
            issuer = op.issue.life if op.issue is not None else killed.get((op.lane, op.number))
            gone = [e for e in op.first_done().values() if e.life in dead_executors]
            if issuer in dead:  # its engine died before the completion came back
                why = f"not applied: engine pid {issuer[0]}, which issued it, was killed"
            elif gone:  # an executor died between completing it and its report arriving
                who = f"{gone[0].source} pid {gone[0].pid}"
                why = f"not applied: {who}, which completed it, was killed"
            else:
                why = "not applied by the end"
            result.in_flight.append(f"{name} (completed {status}; {why})")


def _every_rank_done(
    log: RunLog, op: Op, last_done: Counter[tuple[str, int]], result: CheckResult
) -> bool:
    """Whether every rank of the op's lane completed it; if not, what that means at each rank
    that did not: applied anyway, a hole in the rank's lane, or still in flight."""
    name, first = op_name(op), op.first_done()
    missing = [rank for rank in log.ranks(op.lane) if rank not in first]
    if not missing:
        return True
    actor = LANE_ACTORS[op.lane]
    if op.applied:
        executors = ", ".join(f"{actor}-{rank}" for rank in missing)
        done = "".join(f" ({e.source} did)" for e in first.values())
        result.violations.append(
            Violation(
                "ops",
                f"the engine applied {name}, which {executors} never completed{done}: an op is "
                "complete only once every rank reported it",
                (op.applied[0], *entries_of(op.issue), *first.values()),
            )
        )
        return False
    if op.issue is None:
        return False
    pending = [rank for rank in missing if op.number >= last_done[op.lane, rank]]
    for rank in missing:
        if rank not in pending:
            later = last_done[op.lane, rank]
            result.violations.append(
                Violation(
                    "ops",
                    f"{actor}-{rank}: {name} never completed, though {op.lane} op {later} did",
                    (op.issue,),
                )
            )
    if pending and first:
        at = ", ".join(f"{actor}-{rank}" for rank in pending)
        result.in_flight.append(f"{name} (issued, not completed at {at} by the end of the log)")
    elif pending:
        result.in_flight.append(f"{name} (issued, not completed by the end of the log)")
    return False


def _applied_after_reports(op: Op, receipts: dict[int, Entry] | None, result: CheckResult) -> None:
    """The engine applied the op only after it received every rank's report: the message
    each executor sent right after its completion was received (``msg.recv``, when both
    ends logged it) before the application, in the engine's own log."""
    applied = op.applied[0]
    for done in op.first_done().values():
        receive = (receipts or {}).get(id(done))
        if receive is None or receive.source != applied.source or receive.life != applied.life:
            continue
        if receive.line > applied.line:
            result.violations.append(
                Violation(
                    "ops",
                    f"the engine applied {op_name(op)} before it received {done.source}'s "
                    "report of it",
                    (applied, receive, done),
                )
            )


def _report_receipts(log: RunLog) -> dict[int, Entry]:
    """id(completion) -> the engine's ``msg.recv`` of the report its executor sent next (the
    first ``msg.send`` to an engine after it, by the same process)."""
    received = log.received
    receipts: dict[int, Entry] = {}
    for entries in log.sources.values():
        pending: Entry | None = None
        for entry in entries:
            if entry.event in DONE_EVENTS:
                pending = entry
            elif (
                pending is not None
                and entry.event == "msg.send"
                and str(entry.get("peer")).startswith("engine-")
                and entry.life == pending.life
            ):
                receive = received.get(id(entry))
                if receive is not None:
                    receipts[id(pending)] = receive
                pending = None
    return receipts


Life = tuple[int, int]  # Entry.life: (pid, starts before it in that process)


def _dead_engines(log: RunLog) -> set[Life]:
    """The lives of the engines that died without stopping (no ``actor.stop`` in their log)
    while an engine after them went on."""
    engine = log.sources.get("engine-0", [])
    lives = list(dict.fromkeys(e.life for e in engine))
    stopped = {e.life for e in engine if e.event == "actor.stop"}
    return {life for life in lives[:-1] if life not in stopped}


def _dead_executors(log: RunLog) -> set[Life]:
    """The lives of the executors (Worker and lane ranks) that died without stopping while a
    later incarnation of theirs went on: a report of theirs may never have reached the
    engine, which then recomputes (a restart ends every op in flight)."""
    dead: set[Life] = set()
    for source, entries in log.sources.items():
        if source.partition("-")[0] not in LANE_ACTORS.values():
            continue
        lives = list(dict.fromkeys(e.life for e in entries))
        stopped = {e.life for e in entries if e.event == "actor.stop"}
        dead |= {life for life in lives[:-1] if life not in stopped}
    return dead


def _killed_engines(log: RunLog) -> dict[tuple[str, int], Life]:
    """The ops a killed engine may have issued without its log saying so: (lane, number) ->
    its life. An engine's trace lines are buffered, and one killed (no ``actor.stop`` in
    its log) takes the last of them along; those ops come after the last it logged
    issuing, and before the first an engine after it issued."""
    engine = log.sources.get("engine-0", [])
    lives = list(dict.fromkeys(e.life for e in engine))
    stopped = {e.life for e in engine if e.event == "actor.stop"}
    issued: dict[Life, dict[str, list[int]]] = {life: {} for life in lives}
    for op in log.ops.values():
        if op.issue is not None and op.issue.life in issued:
            issued[op.issue.life].setdefault(op.lane, []).append(op.number)
    lost: dict[tuple[str, int], Life] = {}
    for i, life in enumerate(lives):
        if life in stopped:
            continue
        later = lives[i + 1] if i + 1 < len(lives) else None
        for lane in LANE_NAMES:
            start = max(issued[life].get(lane, [0])) + 1
            end = min(issued[later].get(lane, [1 << 62])) if later is not None else 1 << 62
            for op in log.ops.values():
                if op.lane == lane and start <= op.number < end and op.issue is None:
                    lost[(lane, op.number)] = life
    return lost

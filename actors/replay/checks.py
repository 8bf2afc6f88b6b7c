"""The checks of ``ringfence replay``: the protocol's invariants, proved or refuted from logs.

Every check reads only what the actors logged (see ``log.py``), never the code's
own bookkeeping, so a bug in the scheduler's fences is found as surely as a lane that
ran without waiting:

With ``parallel.tp_size`` = N every op goes to every rank (docs/design.md, "Ranks (tensor
parallelism)"): each rank's executor runs it on its own shard, waiting only on its own
rank's watermarks, and the engine counts it complete once every rank reported it. So every
check below that reads a completion reads each rank's, on its own: a completion at one rank
never vouches for another, and each finding names the executor (``worker-1``, ``swap-0``).

- **I1-I4** (needs the engine's trace: ``op.issue`` with every block an op touches).
  Walking the ops in the scheduler's issue order, an independent per-block record of
  the last writer and the last user of each device and host block in each lane gives,
  for every op and every other lane, the latest earlier op it conflicts with (at
  least one of the two writes the block). At every rank, the op must have *seen* that
  op's lane watermark at or past it before it touched a block (``seen_*`` of its
  completion at that rank: else the violation really happened there), and its fence
  must name it (else the run was lucky: the scheduler's fence is too weak). Device
  reads after a write: I1 for a step (after a swap-in), I2 for a swap-out (after a
  step); a device block overwritten while an earlier op of another lane still uses it:
  I3; any host block conflict: I4.
- **declared** (trace: ``op.issue``'s ``declared`` and the executors' ``op.touched``):
  every block an executor touched was among the blocks its op declared to the fence
  tracker, at every rank (see ``declared.py``).
- **wait**: every op that ran saw, at each rank, each lane's watermark at or past its
  fence.
- **lanes**: each lane at each rank completed ops 1, 2, 3, ... with no gap and none
  twice (twice is allowed only across a restart of the executor, which redoes its op in
  flight).
- **ops**: every issued op completed (ok, failed, rejected or cancelled) at every rank,
  or is reported as still in flight at the end of the log where no later op of its lane
  completed at that rank; nothing was executed that the engine never issued; the engine
  applied an op only once every rank had completed it, after it received every rank's
  report (where the ring messages were logged), with the status the ranks reported (the
  worst of them), or dropped it as stale (see ``completions.py``).
- **rings** (trace: ``msg.send``/``msg.recv``): every ring delivers its sequence numbers
  in order with no gap and no duplicate within one incarnation of the logging end (a
  killed process's last trace lines may never have reached its log, so across its
  restart numbers may jump ahead, and a restarted receiver may get its last message
  again).
- **epochs**: no result or completion of another epoch than the engine's at the time
  was applied (the engine's epoch is the one it started in, raised by each
  ``engine.tier_reset``: once per restart of the Worker, whose ranks restart together),
  and no step of an older epoch ran on a restarted Worker rank.
- **requests**: every request that arrived finished or was aborted once, or is
  reported as still in flight (also one in flight in an engine that died, unless the
  next engine ran it again); none finished that never arrived.
- **grammar** (trace: ``sched.add`` and ``sched.step``): every output token of a request
  with a structured output was one its grammar allowed (see ``grammar.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Final

from ringfence.actors.replay.completions import check_ops
from ringfence.actors.replay.declared import check_declared
from ringfence.actors.replay.findings import TOUCHED, CheckResult, Violation, op_name
from ringfence.actors.replay.grammar import check_grammars
from ringfence.actors.replay.invariants import check_invariants
from ringfence.actors.replay.records import LANE_NAMES, Entry, RunLog

CHECKS: Final = {
    "I1": "no step read a device block before the swap-in that fills it was done",
    "I2": "no swap-out read a device block before the step that wrote it was done",
    "I3": "no device block was overwritten while an op of another lane still used it",
    "I4": "no host block was read before it was filled, nor overwritten while still read",
    "declared": "every block an executor touched was declared to the fence tracker",
    "wait": "every op saw the watermarks its fence names before it ran",
    "lanes": "each lane completed its ops in order, none skipped, none twice",
    "ops": "every issued op completed and was applied, or is still in flight",
    "rings": "no sequence gap or duplicate on any ring",
    "epochs": "no result of another epoch was applied",
    "requests": "every request that arrived finished, was aborted, or is in flight",
    "grammar": "every output token of a structured output was one its grammar allowed",
}


def check_run(log: RunLog) -> CheckResult:
    """Run every check the log allows (see the module docstring)."""
    result = CheckResult()
    if log.traced:
        check_invariants(log, result)
        check_declared(log, result)
    else:
        result.skipped.append(
            "I1-I4, declared, rings and the ops' application (the engine logged at info; set "
            "runtime.log_level=trace)"
        )
    _waits(log, result)
    _lanes(log, result)
    check_ops(log, result)
    if log.traced:
        _rings(log, result)
    _epochs(log, result)
    _requests(log, result)
    if log.traced:
        check_grammars(log, result)
    rank = {check: i for i, check in enumerate(CHECKS)}
    result.violations.sort(key=lambda v: (v.at.order if v.at else -1, rank.get(v.check, 99)))
    return result


def _waits(log: RunLog, result: CheckResult) -> None:
    for op in log.ops.values():
        for done in op.first_done().values():
            if str(done.get("status")) not in TOUCHED:
                continue
            result.counts["wait"] += 1
            for lane in LANE_NAMES:
                target = int(done.get(f"fence_{lane}") or 0)
                seen = done.get(f"seen_{lane}")
                if lane != op.lane and target and seen is not None and int(seen) < target:
                    result.violations.append(
                        Violation(
                            "wait",
                            f"{done.source}: {op_name(op)} ran having seen {lane}_done at "
                            f"{seen}; its fence names {lane} {target}",
                            (done,),
                        )
                    )


def _lanes(log: RunLog, result: CheckResult) -> None:
    """Each lane at each rank (each executor) completes 1, 2, 3, ... on its own."""
    executors: dict[tuple[str, int], list[Entry]] = defaultdict(list)
    for op in log.ops.values():
        for done in op.done:
            executors[op.lane, done.rank].append(done)
    for (lane, _), completions in sorted(executors.items()):
        completions.sort(key=lambda e: e.order)
        expected, last_life = 1, None
        seen: dict[int, Entry] = {}
        for done in completions:
            result.counts["lanes"] += 1
            number = int(done.get("op") if lane != "step" else done.get("step"))
            if number in seen:
                if seen[number].life == done.life:
                    result.violations.append(
                        Violation(
                            "lanes",
                            f"{done.source}: {lane} op {number} completed twice",
                            (done, seen[number]),
                        )
                    )
                continue  # redone after a restart (its completion was not yet reported)
            if number != expected and not (number < expected and done.life != last_life):
                skipped = f"{expected}" if number == expected + 1 else f"{expected}-{number - 1}"
                result.violations.append(
                    Violation(
                        "lanes",
                        f"{done.source}: {lane} op {number} completed when op {expected} was "
                        f"next: op {skipped} never completed",
                        (done,),
                    )
                )
            seen[number] = done
            expected, last_life = max(expected, number + 1), done.life


def _rings(log: RunLog, result: CheckResult) -> None:
    for source, entries in log.sources.items():
        # A message whose handler was blocked on a peer is handed over again: received twice.
        deferred = {
            (e.life, str(e.get("peer")), e.get("seq")) for e in entries if e.event == "msg.deferred"
        }
        for event in ("msg.recv", "msg.send"):
            selected = (e for e in entries if e.event == event)
            _ring_order(source, selected, event, result, deferred if event == "msg.recv" else set())


def _ring_order(
    source: str,
    entries: Iterable[Entry],
    event: str,
    result: CheckResult,
    deferred: set[tuple[tuple[int, int], str, object]],
) -> None:
    """Sequence numbers on each ring seen from one end: +1 each time within an incarnation
    of the logging end (a restarted one may get its last message again, or have lost the
    last lines it logged), the same again after it was deferred; a client's ring starts
    again at 1 when a client takes the slot anew."""
    last: dict[str, tuple[int, tuple[int, int], Entry]] = {}
    for entry in entries:
        seq, peer = int(entry.get("seq") or 0), str(entry.get("peer"))
        if seq == 0:  # a timer or a message to itself: not on a ring
            continue
        result.counts["rings"] += 1
        previous = last.get(peer)
        last[peer] = (seq, entry.life, entry)
        expected = previous[0] + 1 if previous else 1
        if seq == expected:
            continue
        restarted = previous is not None and previous[1] != entry.life
        client = peer.startswith("client-") or source.startswith("client-")
        if restarted or (client and seq == 1):
            continue
        if previous is not None and seq == previous[0] and (entry.life, peer, seq) in deferred:
            continue
        if previous is not None and seq < expected:
            what = f"sequence number {seq} again (after {previous[0]})"
            causes: tuple[Entry, ...] = (entry, previous[2])
        else:
            what = f"sequence number {seq} when {expected} was next (a gap)"
            causes = (entry,)
        side = "received from" if event == "msg.recv" else "sent to"
        result.violations.append(Violation("rings", f"{source} {side} {peer}: {what}", causes))


def _epochs(log: RunLog, result: CheckResult) -> None:
    engine_epoch: dict[tuple[int, int], int] = {}  # an engine's life -> its epoch now
    events = ("sched.step", "sched.transfer", "step.done", "engine.tier_reset")
    for entry in log.events(*events):
        if entry.event == "engine.tier_reset":
            engine_epoch[entry.life] = int(entry.get("new_epoch"))
            continue
        result.counts["epochs"] += 1
        if entry.event == "step.done":
            plan = entry.get("plan_epoch")
            if entry.get("status") == "ok" and plan is not None and int(plan) < entry.epoch:
                result.violations.append(
                    Violation(
                        "epochs",
                        f"{entry.source} ran step {entry.get('step')} of epoch {plan} in epoch "
                        f"{entry.epoch}: a plan for a device tier since reset",
                        (entry,),
                    )
                )
            continue
        msg_epoch = entry.get("msg_epoch")
        epoch = engine_epoch.get(entry.life, entry.epoch)
        if msg_epoch is not None and int(msg_epoch) != epoch:
            lane = entry.get("lane") or "step"
            number = entry.get("op") or entry.get("step")
            result.violations.append(
                Violation(
                    "epochs",
                    f"the engine (epoch {epoch}) applied {lane} op {number}'s "
                    f"completion of epoch {msg_epoch}",
                    (entry,),
                )
            )


def _requests(log: RunLog, result: CheckResult) -> None:
    arrived: dict[str, Entry] = {}
    finished: dict[str, Entry] = {}
    lost: dict[str, int] = {}  # request -> pid of the engine it was in flight in when it died
    engine_life: tuple[int, int] | None = None
    for entry in log.events("request.arrive", "request.finish"):
        request = str(entry.get("request"))
        result.counts["requests"] += 1
        if entry.life != engine_life:
            # A new engine incarnation: what the last one left in flight died with it (a
            # workload's next engine runs it again, a client was told it is gone).
            lost |= {r: e.pid for r, e in arrived.items() if r not in finished}
            arrived.clear()
            finished.clear()
            engine_life = entry.life
        lost.pop(request, None)
        if entry.event == "request.arrive":
            if request in arrived and request not in finished:
                result.violations.append(
                    Violation("requests", f"request {request} arrived twice", (entry,))
                )
            arrived[request] = entry
            finished.pop(request, None)  # a client may reuse an id once it ended
        elif request not in arrived:
            result.violations.append(
                Violation("requests", f"request {request} finished but never arrived", (entry,))
            )
        elif request in finished:
            result.violations.append(
                Violation(
                    "requests", f"request {request} finished twice", (entry, finished[request])
                )
            )
        else:
            finished[request] = entry
    engine = log.sources.get("engine-0")
    last_engine = engine[-1].life if engine else None
    for request, entry in arrived.items():
        if request in finished:
            continue
        if entry.life != last_engine:
            lost[request] = entry.pid
        else:
            result.in_flight.append(f"request {request} (arrived, not finished)")
    for request, pid in lost.items():
        result.in_flight.append(f"request {request} (in flight when engine pid {pid} ended)")

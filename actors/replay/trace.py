"""A run's logs as a Chrome trace event file, for Perfetto (``ringfence replay``).

:func:`write_trace` writes the JSON object format (``{"traceEvents": [...],
"displayTimeUnit": "ms"}``) that ui.perfetto.dev and chrome://tracing open:

- one process per actor instance (the log's stem, ``worker-0``), pids in a fixed order
  (supervisor, engine, worker, swap, store, then the rest by name);
- a thread per lane on its executor ("step lane" on the worker, "swap lane", "store
  lane"): a slice per completed op ("step 12", "swap-in 3", "swap-out 4", "write-back 5",
  "prefetch 6") with a nested "fence wait" slice for the time it waited on its fence, and
  an instant "<op> never completed" at the issue of an op no completion was logged for
  (on each rank's executor that logged none);
- flow arrows (category "fence") from the end of op ``(L, n)`` to the start of every op
  whose fence on lane L is ``n``, rank by rank (rank r waits on rank r's watermarks);
- on the engine, a "scheduler" thread with an instant per ``sched.schedule`` round and
  per ``op.issue``, and a "requests" async slice per request from arrive to finish;
- on the supervisor, instants for the launch, spawns, exits, restarts and the end; any
  other warning or error an actor logged is an instant on its "log" thread;
- with ``transfer.profile`` on, each executor's profiler trace (``profiles.py``) on its
  process: its op ranges on an "ops" thread, and on a GPU each stream's kernels and copies.

An op's slice ends at its completion's ``ts`` and begins ``wait_ns + exec_ns`` (a
transfer's ``copy_ns``) earlier; on one lane a slice never starts before the previous one
ends (clock jitter would otherwise break the nesting Perfetto needs). Timestamps are
microseconds from the earliest moment logged.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any, Final

import orjson

from ringfence.actors.replay.findings import op_name
from ringfence.actors.replay.profiles import ProfiledSlice
from ringfence.actors.replay.records import LANE_ACTORS, LANE_NAMES, Entry, Op, RunLog

SUPERVISOR_EVENTS: Final = frozenset(
    {"run.start", "actor.spawn", "actor.exit", "actor.restart", "actor.group_restart", "run.end"}
)
ACTOR_ORDER: Final = ("supervisor", "engine", "worker", "swap", "store")
COMMON_FIELDS: Final = frozenset({"ts", "mono_ns", "level", "actor", "rank", "pid", "event"})
MIN_SLICE_S: Final = 2e-6  # a cancelled op took no time, but a flow needs a slice to bind to
FLOW_INSET_US: Final = 1.0  # flow ends sit this far inside their slices, or Perfetto drops them

Event = dict[str, Any]
Where = tuple[int, int]  # (pid, tid)


@dataclass(slots=True)
class _Slice:
    op: Op
    done: Entry
    name: str
    where: Where
    start: float  # seconds, wall clock
    end: float
    wait: float


class _Tracks:
    """Process and thread ids, handed out on first use with their name metadata events."""

    def __init__(self, sources: list[str]) -> None:
        self.meta: list[Event] = []
        self.pids: dict[str, int] = {}
        self.tids: dict[tuple[str, str], int] = {}
        for source in sorted(sources, key=_source_rank):
            self.pid(source)

    def pid(self, source: str) -> int:
        if source not in self.pids:
            pid = self.pids[source] = len(self.pids) + 1
            self.meta.append(_meta("process_name", pid, None, source))
            self.meta.append(_meta("process_sort_index", pid, None, pid))
        return self.pids[source]

    def tid(self, source: str, thread: str) -> Where:
        """(pid, tid); tids are unique across processes (Perfetto takes them as global)."""
        pid = self.pid(source)
        tid = self.tids.get((source, thread))
        if tid is None:
            tid = self.tids[source, thread] = pid * 100 + sum(s == source for s, _ in self.tids)
            self.meta.append(_meta("thread_name", pid, tid, thread))
        return pid, tid


def write_trace(log: RunLog, path: str | Path, profiled: Sequence[ProfiledSlice] = ()) -> int:
    """Write ``log`` (and the ``profiled`` slices of its executors' profiles) as a Chrome
    trace event file at ``path``; return the events written."""
    tracks = _Tracks(list(log.sources))
    slices = _op_slices(log, tracks)
    stamps = [e.ts for e in log.history if e.ts > 0] + [s.start for s in slices]
    stamps += [p.start for p in profiled]
    origin = min(stamps, default=0.0)

    def us(ts: float) -> float:
        return round((ts - origin) * 1e6, 3)

    events: list[Event] = []
    first: dict[tuple[str, int, int], _Slice] = {}  # (lane, number, rank) -> its first slice
    for s in slices:
        key = (s.op.lane, s.op.number, s.done.rank)
        if key not in first or s.done.order < first[key].done.order:
            first[key] = s  # flows join first completions, not redone ones
        start, dur = us(s.start), round(us(s.end) - us(s.start), 3)
        events.append(_event("X", s.name, "op", s.where, start, dur=dur, args=_op_args(s)))
        if s.wait > 0:
            wait = min(round(s.wait * 1e6, 3), dur)
            events.append(_event("X", "fence wait", "fence", s.where, start, dur=wait))
    flow = 0
    for s in first.values():
        for lane in LANE_NAMES:
            fence = s.op.fence(lane)
            before = first.get((lane, fence, s.done.rank)) if lane != s.op.lane else None
            if before is None:
                continue
            flow += 1  # both ends well inside their slices, or Perfetto binds them to none
            inset = min(FLOW_INSET_US, (us(before.end) - us(before.start)) / 2)
            events.append(
                _event("s", "fence", "fence", before.where, us(before.end) - inset, id=flow)
            )
            inset = min(FLOW_INSET_US, (us(s.end) - us(s.start)) / 2)
            events.append(
                _event("f", "fence", "fence", s.where, us(s.start) + inset, id=flow, bp="e")
            )
    for op in log.ops.values():
        at = op.issue or next(iter(op.applied + op.stale + op.extra_issues), None)
        if at is None:
            continue
        done = op.first_done()
        for rank in (rank for rank in log.ranks(op.lane) if rank not in done):
            executor = f"{LANE_ACTORS.get(op.lane, op.lane)}-{rank}"
            where = tracks.tid(executor, f"{op.lane} lane")
            name = f"{op_name(op)} never completed"
            events.append(_event("i", name, "op", where, us(at.ts), s="t", args=_fields(at)))
    for entry in log.history:
        events.extend(_entry_events(entry, tracks, us(entry.ts)))
    for p in profiled:
        where = tracks.tid(p.source, p.track)
        start, dur = us(p.start), round(p.duration * 1e6, 3)
        events.append(_event("X", p.name, p.category, where, start, dur=dur, args=p.args))
    events = tracks.meta + events
    Path(path).write_bytes(orjson.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return len(events)


def _op_slices(log: RunLog, tracks: _Tracks) -> list[_Slice]:
    """Every completion of every op, as a slice on its executor's lane thread."""
    lanes: dict[Where, list[_Slice]] = defaultdict(list)
    for op in log.ops.values():
        for again, done in enumerate(op.done):
            where = tracks.tid(done.source, f"{op.lane} lane")
            wait = (done.get("wait_ns") or 0) / 1e9
            work = (done.get("exec_ns" if op.lane == "step" else "copy_ns") or 0) / 1e9
            name = op_name(op) + (" (again)" if again else "")
            start = min(done.ts - wait - work, done.ts - MIN_SLICE_S)  # cancelled: 0 s
            lanes[where].append(_Slice(op, done, name, where, start, done.ts, wait))
    slices: list[_Slice] = []
    for lane in lanes.values():
        lane.sort(key=lambda s: (s.end, s.start))
        for previous, s in pairwise(lane):
            if s.start < previous.end:  # clock jitter: keep the lane's slices apart
                s.wait = max(0.0, s.wait - (previous.end - s.start))
                s.start = previous.end
        slices.extend(lane)
    return slices


def _op_args(s: _Slice) -> dict[str, Any]:
    op, done, step = s.op, s.done, s.op.lane == "step"
    args: dict[str, Any] = {"lane": op.lane, "op": op.number, "status": done.get("status")}
    args["fence"] = {lane: op.fence(lane) for lane in LANE_NAMES if lane != op.lane}
    for lane in LANE_NAMES:
        if lane != op.lane:
            args[f"seen_{lane}"] = done.get(f"seen_{lane}")
    for key in ("pieces", "tokens", "poison") if step else ("direction", "blocks", "missing"):
        args[key] = done.get(key)
    args["wait_ms"] = (done.get("wait_ns") or 0) / 1e6
    args["exec_ms" if step else "copy_ms"] = (done.get("exec_ns" if step else "copy_ns") or 0) / 1e6
    args["epoch"] = done.get("plan_epoch" if step else "op_epoch")
    if op.issue is not None:
        args |= {"reason": op.issue.get("reason"), "sync": op.issue.get("sync")}
    args |= {"error": done.get("error"), "log": done.where}
    return {key: value for key, value in args.items() if value is not None and value != []}


def _entry_events(entry: Entry, tracks: _Tracks, ts: float) -> list[Event]:
    """The instants and request slices one log entry stands for (often none)."""
    name, source = entry.event, entry.source
    if name in ("request.arrive", "request.finish") and entry.get("request") is not None:
        request = str(entry.get("request"))
        where = tracks.tid(source, "requests")
        ph = "b" if name == "request.arrive" else "e"
        return [
            _event(ph, f"request {request}", "request", where, ts, id=request, args=_fields(entry))
        ]
    if name == "sched.schedule":
        args = {"ops": entry.get("ops"), "decisions": entry.get("decisions")}
        return [
            _event("i", "schedule", "sched", tracks.tid(source, "scheduler"), ts, s="t", args=args)
        ]
    if name == "op.issue":
        args = _fields(entry)
        pieces = args.pop("pieces", None) or ()
        if pieces:
            args |= {"pieces": len(pieces), "tokens": sum(int(piece[2]) for piece in pieces)}
        for key in ("device_blocks", "host_blocks"):
            if key in args:
                args[key] = len(args[key] or ())
        op = Op(str(entry.get("lane")), int(entry.get("op") or 0), issue=entry)
        where = tracks.tid(source, "scheduler")
        return [_event("i", f"issue {op_name(op)}", "sched", where, ts, s="t", args=args)]
    if name in SUPERVISOR_EVENTS:
        label = f"{name} {entry.get('instance')}" if entry.get("instance") else name
        where = tracks.tid(source, "lifecycle")
        return [_event("i", label, "run", where, ts, s="t", args=_fields(entry))]
    if entry.get("level") in ("warning", "error"):
        where = tracks.tid(source, "log")
        return [_event("i", name, str(entry.get("level")), where, ts, s="t", args=_fields(entry))]
    return []


def _source_rank(source: str) -> tuple[int, str]:
    actor = source.rsplit("-", 1)[0]
    return (ACTOR_ORDER.index(actor) if actor in ACTOR_ORDER else len(ACTOR_ORDER), source)


def _fields(entry: Entry) -> dict[str, Any]:
    return {k: v for k, v in entry.data.items() if k not in COMMON_FIELDS and v is not None}


def _meta(name: str, pid: int, tid: int | None, value: object) -> Event:
    key = "sort_index" if name.endswith("sort_index") else "name"
    event = {"ph": "M", "name": name, "pid": pid, "args": {key: value}}
    return event if tid is None else event | {"tid": tid}


def _event(ph: str, name: str, cat: str, where: Where, ts: float, **extra: Any) -> Event:
    return {"ph": ph, "name": name, "cat": cat, "pid": where[0], "tid": where[1], "ts": ts} | extra

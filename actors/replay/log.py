"""A run's logs for replay: every actor's JSON lines, read and merged in happens-before order.

:func:`read_run` reads each ``<actor>-<rank>.jsonl`` of a run dir (DESIGN.md "Logs and
replay"; the events and fields are catalogued in ``runtime/events.py``), skipping a
partial last line (a process killed mid-write) or any line that is not a JSON object
with a warning, and keeps only the last launch when the supervisor log shows several
on the same run dir. It gathers every numbered op of the three lanes into :class:`Op`
records (the engine's ``op.issue``, the executor's ``step.done``/``lane.done``, the
engine's application ``sched.step``/``sched.transfer`` or ``engine.stale``) and orders
all entries by the protocol's own happens-before:

- program order within each file;
- a ring message's ``msg.send`` before its ``msg.recv`` (same ring, same sequence number);
- an op's ``op.issue`` before each rank's completion of it, and every rank's before the
  engine applies it (DESIGN.md "Ranks": the engine counts an op complete once every rank
  reported it);
- the completion of op ``n`` of lane L at rank r before the completion at rank r of any
  op whose executor saw L's watermark at ``n`` or more before it touched a block (rank
  r's executors wait only on rank r's watermarks).

Clocks (``ts``) only break ties among entries no edge orders. Nothing here judges the
run; see ``checks.py``.
"""

from __future__ import annotations

import heapq
import tomllib
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import orjson

LANE_NAMES: Final = ("step", "swap", "store")
LANE_ACTORS: Final = {"step": "worker", "swap": "swap", "store": "store"}  # each lane's executor
# An op whose ranks report different statuses has the worst of them, in this order (as the
# engine's ledger combines them: actors/engine/ledger.py).
WORST_LAST: Final = ("ok", "cancelled", "failed", "rejected")
DONE_EVENTS: Final = ("step.done", "lane.done")
APPLY_EVENTS: Final = ("sched.step", "sched.transfer")
NOT_LOGS: Final = frozenset({"outputs.jsonl"})  # the run's results, not a log


@dataclass(slots=True, eq=False)
class Entry:
    """One log line: where it came from and its fields (``data``, as written)."""

    source: str  # the log's file stem, "<actor>-<rank>" ("engine-0")
    line: int  # 1-based line number in that file
    data: dict[str, Any]
    order: int = -1  # position in the merged history (set by read_run)
    event: str = field(init=False)  # data["event"], read once (it is read everywhere)
    ts: float = field(init=False)  # data["ts"], 0.0 when missing

    def __post_init__(self) -> None:
        self.event = str(self.data["event"])
        ts = self.data.get("ts")
        self.ts = float(ts) if isinstance(ts, int | float) else 0.0

    @property
    def pid(self) -> int:
        return int(self.data.get("pid") or 0)

    @property
    def epoch(self) -> int:
        return int(self.data.get("epoch") or 0)

    @property
    def rank(self) -> int:
        """The logging actor's rank: the line's ``rank``, else the log's name says it."""
        rank = self.data.get("rank")
        if isinstance(rank, int):
            return rank
        suffix = self.source.rsplit("-", 1)[-1]
        return int(suffix) if suffix.isdigit() else 0

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    @property
    def where(self) -> str:
        return f"{self.source}.jsonl:{self.line}"

    def describe(self, fields: int = 12) -> str:
        """``engine-0.jsonl:57 op.issue lane=step op=4 ...``: one line for a report."""
        skip = {"ts", "mono_ns", "level", "actor", "rank", "pid", "event", "exception"}
        parts = []
        for key, value in self.data.items():
            if key in skip or value is None:
                continue
            text = orjson.dumps(value).decode() if not isinstance(value, str) else value
            parts.append(f"{key}={text if len(text) <= 60 else text[:57] + '...'}")
            if len(parts) == fields:
                break
        return f"{self.where} {self.event} {' '.join(parts)}"


Tier = str  # "device" or "host"
Blocks = dict[Tier, frozenset[int]]


@dataclass(slots=True, eq=False)
class Op:
    """Everything logged about one numbered op of a lane."""

    lane: str  # "step", "swap" or "store"
    number: int
    issue: Entry | None = None  # the engine's op.issue (trace level only)
    done: list[Entry] = field(default_factory=list)  # every rank's completions (one each, normally)
    applied: list[Entry] = field(default_factory=list)  # the engine's sched.step/sched.transfer
    stale: list[Entry] = field(default_factory=list)  # engine.stale: dropped, an older epoch
    extra_issues: list[Entry] = field(default_factory=list)  # op.issue again: a violation
    touched: list[Entry] = field(default_factory=list)  # every rank's op.touched (trace level)
    _first: tuple[int, dict[int, Entry]] | None = field(default=None, repr=False)  # first_done

    @property
    def kind(self) -> str:
        """ "step", or the transfer's direction: "in", "out", "write" or "read"."""
        if self.lane == "step":
            return "step"
        for entry in (self.issue, *self.done):
            if entry is not None and entry.get("direction"):
                return str(entry.get("direction"))
        return "?"

    def first_done(self) -> dict[int, Entry]:
        """Each rank's first completion (a restarted executor may complete an op again),
        by rank in rank order."""
        if self._first is None or self._first[0] != len(self.done):  # not each time: it is read
            first: dict[int, Entry] = {}
            for entry in self.done:
                first.setdefault(entry.rank, entry)
            self._first = (len(self.done), dict(sorted(first.items())))
        return self._first[1]

    @property
    def status(self) -> str | None:
        """The op's status as the engine combines its ranks' (the worst of each rank's first
        completion, ``WORST_LAST``), or None if no rank completed it."""
        statuses = {str(entry.get("status")) for entry in self.first_done().values()}
        if not statuses:
            return None
        return max(statuses, key=lambda s: WORST_LAST.index(s) if s in WORST_LAST else 99)

    def status_at(self, rank: int) -> str | None:
        """Rank ``rank``'s status of its first completion, or None if it never completed."""
        done = self.first_done().get(rank)
        return str(done.get("status")) if done is not None else None

    def seen(self, lane: str, rank: int) -> int | None:
        """Lane ``lane``'s watermark at ``rank`` that rank's executor saw before it touched a
        block (its first completion's ``seen_<lane>``); None if it did not complete."""
        done = self.first_done().get(rank)
        value = done.get(f"seen_{lane}") if done is not None else None
        return int(value) if value is not None else None

    def fence(self, lane: str) -> int:
        """The fence on ``lane``: the scheduler's (op.issue) when logged, else the message's."""
        if self.issue is not None:
            return int((self.issue.get("fence") or {}).get(lane, 0))
        if self.done:
            return int(self.done[0].get(f"fence_{lane}") or 0)
        return 0

    def access(self, block_size: int) -> tuple[Blocks, Blocks]:
        """(reads, writes) per tier, from op.issue; empty when it was not logged.

        A step reads the blocks holding KV before its pieces' first positions (a partly
        filled last one included) and writes the blocks of the positions it computes, and
        the blocks it poisons; a swap-in reads host and writes
        device blocks, a swap-out the reverse; a write-back reads host blocks; a prefetch
        writes them.
        """
        issue = self.issue
        if issue is None:
            return {}, {}
        if self.lane == "step":
            reads: set[int] = set()
            writes: set[int] = set(issue.get("poison") or ())
            for piece in issue.get("pieces") or ():
                _, start, count, _, table = piece
                first, partial = divmod(start, block_size)
                reads.update(table[: first + (1 if partial else 0)])  # KV already there
                writes.update(table[first : -(-(start + count) // block_size)])
            return {"device": frozenset(reads)}, {"device": frozenset(writes)}
        device = frozenset(issue.get("device_blocks") or ())
        host = frozenset(issue.get("host_blocks") or ())
        kind = self.kind
        if kind == "in":
            return {"host": host}, {"device": device}
        if kind == "out":
            return {"device": device}, {"host": host}
        if kind == "write":
            return {"host": host}, {}
        return {}, {"host": host}  # a prefetch


@dataclass(slots=True)
class RunLog:
    """A run's merged history (see the module docstring)."""

    run_dir: Path
    sources: dict[str, list[Entry]]  # per log file, in file order
    history: list[Entry]  # every entry, in happens-before order
    ops: dict[tuple[str, int], Op]  # (lane, number) -> its record
    issue_order: list[tuple[str, int]]  # the scheduler's issue order across lanes
    config: dict[str, Any]  # config.toml of the run dir ({} when absent)
    warnings: list[str]  # lines skipped, launches ignored, clock-ordered cycles
    traced: bool  # the engine logged at trace level: op.issue, sched.*, msg.* are there
    lane_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # see _lane_ranks
    received: dict[int, Entry] = field(default_factory=dict)  # id(msg.send) -> its msg.recv

    @property
    def block_size(self) -> int:
        return int(self.config.get("cache", {}).get("block_size", 16))

    def ranks(self, lane: str) -> tuple[int, ...]:
        """The ranks that execute ``lane``, each of which must complete every op of it."""
        return self.lane_ranks.get(lane, (0,))

    def events(self, *names: str, source: str | None = None) -> Iterator[Entry]:
        """Entries of these events (every event when none), in history order."""
        wanted = set(names)
        for entry in self.history if source is None else self.sources.get(source, ()):
            if not wanted or entry.event in wanted:
                yield entry

    def around(self, entry: Entry, before: int = 8, after: int = 4) -> list[Entry]:
        """The entries just before and after ``entry`` in the merged history."""
        at = entry.order
        return self.history[max(0, at - before) : at + after + 1]


class ReplayError(ValueError):
    """The run dir cannot be replayed at all (no logs in it)."""


def read_run(run_dir: str | Path) -> RunLog:
    """Read and merge the logs of ``run_dir`` (see the module docstring)."""
    root = Path(run_dir)
    if not root.is_dir():
        raise ReplayError(f"{root} is not a directory")
    files = sorted(p for p in root.glob("*.jsonl") if p.name not in NOT_LOGS)
    if not files:
        raise ReplayError(f"{root} holds no <actor>-<rank>.jsonl log")
    warnings: list[str] = []
    sources = {p.stem: _read_file(p, warnings) for p in files}
    _last_launch(sources, warnings)
    config: dict[str, Any] = {}
    config_file = root / "config.toml"
    if config_file.is_file():
        config = tomllib.loads(config_file.read_text())
    ops, issue_order = _gather_ops(sources, warnings)
    pairs = list(message_pairs(sources))
    history = _merge(sources, _cross_edges(pairs, ops), warnings)
    for i, entry in enumerate(history):
        entry.order = i
    traced = any(e.get("level") == "trace" for e in sources.get("engine-0", ()))
    ranks, received = _lane_ranks(sources, ops, config), {id(s): r for s, r in pairs}
    return RunLog(
        root, sources, history, ops, issue_order, config, warnings, traced, ranks, received
    )


def _lane_ranks(
    sources: dict[str, list[Entry]], ops: dict[tuple[str, int], Op], config: dict[str, Any]
) -> dict[str, tuple[int, ...]]:
    """Per lane, the ranks executing it: ``parallel.tp_size`` of config.toml, and every rank
    with a log of the lane's executor or a completion of one of its ops (rank 0 alone when
    nothing says more)."""
    tp_size = config.get("parallel", {}).get("tp_size", 1)
    ranks: dict[str, set[int]] = {
        lane: set(range(tp_size if isinstance(tp_size, int) else 1)) for lane in LANE_NAMES
    }
    lane_of = {actor: lane for lane, actor in LANE_ACTORS.items()}
    for source in sources:
        actor, _, rank = source.rpartition("-")
        if actor in lane_of and rank.isdigit():
            ranks[lane_of[actor]].add(int(rank))
    for op in ops.values():
        ranks.setdefault(op.lane, set()).update(done.rank for done in op.done)
    return {lane: tuple(sorted(found)) or (0,) for lane, found in ranks.items()}


def _read_file(path: Path, warnings: list[str]) -> list[Entry]:
    data = path.read_bytes()
    lines = data.split(b"\n")
    last = lines.pop()  # b"" when the file ends with a newline
    if last:
        warnings.append(
            f"{path.name}:{len(lines) + 1}: partial last line skipped ({len(last)} bytes; "
            "the process was killed mid-write)"
        )
    stem = path.stem
    numbered = [(n, raw) for n, raw in enumerate(lines, 1) if raw.strip()]
    try:  # one parse of the whole file: the common case, and ~3x faster than line by line
        values = orjson.loads(b"[" + b",".join(raw for _, raw in numbered) + b"]")
    except orjson.JSONDecodeError:
        values = [_parse(path.name, n, raw, warnings) for n, raw in numbered]
    entries = []
    for (number, _), value in zip(numbered, values, strict=True):
        if value is None:
            continue
        if not isinstance(value, dict) or not isinstance(value.get("event"), str):
            warnings.append(f"{path.name}:{number}: not a log event (no 'event'), skipped")
            continue
        entries.append(Entry(stem, number, value))
    return entries


def _parse(name: str, number: int, raw: bytes, warnings: list[str]) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        warnings.append(f"{name}:{number}: not JSON, skipped ({e})")
        return None


def _last_launch(sources: dict[str, list[Entry]], warnings: list[str]) -> None:
    """Keep only the last launch's entries when several launches used this run dir."""
    starts = [e.ts for e in sources.get("supervisor-0", ()) if e.event == "run.start"]
    if len(starts) < 2:
        return
    since = starts[-1]
    for name, entries in sources.items():
        sources[name] = [e for e in entries if e.ts >= since or "ts" not in e.data]
    warnings.append(
        f"{len(starts)} launches used this run dir; replaying the last (run.start at ts {since})"
    )


def _gather_ops(
    sources: dict[str, list[Entry]], warnings: list[str]
) -> tuple[dict[tuple[str, int], Op], list[tuple[str, int]]]:
    ops: dict[tuple[str, int], Op] = {}
    order: list[tuple[str, int]] = []

    def op(lane: str, number: int) -> Op:
        key = (lane, number)
        record = ops.get(key)
        if record is None:
            record = ops[key] = Op(lane, number)
        return record

    for entries in sources.values():
        for entry in entries:
            try:
                _gather(entry, op, order)
            except (TypeError, ValueError) as e:  # a field missing or not a number
                warnings.append(f"{entry.where}: {entry.event} without its numbers, skipped ({e})")
    if not order:  # no scheduling rounds logged: the engine's send order is the next best
        order = [
            (str(e.get("lane")), int(e.get("op")))
            for e in sources.get("engine-0", ())
            if e.event == "op.issue"
        ]
    return ops, order


def _gather(entry: Entry, op: Callable[[str, int], Op], order: list[tuple[str, int]]) -> None:
    name = entry.event
    if name == "op.issue":
        record = op(str(entry.get("lane")), int(entry.get("op")))
        if record.issue is None:
            record.issue = entry
        else:
            record.extra_issues.append(entry)
    elif name == "step.done":
        op("step", int(entry.get("step"))).done.append(entry)
    elif name == "lane.done":
        op(str(entry.get("lane")), int(entry.get("op"))).done.append(entry)
    elif name == "sched.step":
        op("step", int(entry.get("step"))).applied.append(entry)
    elif name == "sched.transfer":
        op(str(entry.get("lane")), int(entry.get("op"))).applied.append(entry)
    elif name == "engine.stale":
        op(str(entry.get("lane")), int(entry.get("op"))).stale.append(entry)
    elif name == "op.touched":
        op(str(entry.get("lane")), int(entry.get("op"))).touched.append(entry)
    elif name == "sched.schedule":
        order.extend((str(lane), int(number)) for lane, number in entry.get("ops") or ())


def _merge(
    sources: dict[str, list[Entry]], edges: Iterable[tuple[Entry, Entry]], warnings: list[str]
) -> list[Entry]:
    """Every entry, topologically sorted by the happens-before edges, ties by clock.

    Program order needs no edges: only the next entry of each file can be placed, once
    every cross edge into it (messages, ops, watermarks) is satisfied; so the ready set
    holds at most one entry per file.
    """
    files = list(sources.values())
    where: dict[int, tuple[int, int]] = {}  # id(entry) -> (file, position)
    for f, entries in enumerate(files):
        for i, entry in enumerate(entries):
            where[id(entry)] = (f, i)
    after: dict[int, list[Entry]] = defaultdict(list)
    waits: dict[int, int] = defaultdict(int)  # id(entry) -> cross edges not yet satisfied
    for a, b in edges:
        if where[id(a)][0] != where[id(b)][0]:  # within a file, program order rules
            after[id(a)].append(b)
            waits[id(b)] += 1
    heads = [0] * len(files)
    ready: list[tuple[float, str, int, int]] = []

    def offer(f: int) -> None:
        if heads[f] < len(files[f]):
            head = files[f][heads[f]]
            if not waits.get(id(head)):
                heapq.heappush(ready, (head.ts, head.source, head.line, f))

    for f in range(len(files)):
        offer(f)
    merged: list[Entry] = []
    total = sum(len(entries) for entries in files)
    while len(merged) < total:
        if not ready:  # a cycle: the log contradicts itself; place by clock and say so
            f = min(
                (f for f in range(len(files)) if heads[f] < len(files[f])),
                key=lambda f: files[f][heads[f]].ts,
            )
            stuck = files[f][heads[f]]
            warnings.append(f"happens-before cycle through {stuck.where}: ordered by clock")
            waits[id(stuck)] = 0
            offer(f)
        *_, f = heapq.heappop(ready)
        entry = files[f][heads[f]]
        heads[f] += 1
        merged.append(entry)
        offer(f)
        for later in after.get(id(entry), ()):
            waits[id(later)] -= 1
            g, i = where[id(later)]
            if waits[id(later)] == 0 and heads[g] == i:
                offer(g)
    return merged


def _cross_edges(
    pairs: list[tuple[Entry, Entry]], ops: dict[tuple[str, int], Op]
) -> Iterator[tuple[Entry, Entry]]:
    """(before, after) pairs the protocol orders (see the module docstring); ``pairs``:
    the ring messages' (send, receive)."""
    yield from pairs
    first_done = {
        (lane, number, rank): done
        for (lane, number), record in ops.items()
        for rank, done in record.first_done().items()
    }
    for record in ops.values():
        for done in record.done:
            if record.issue is not None:
                yield record.issue, done
            for lane in LANE_NAMES:
                seen = done.get(f"seen_{lane}")
                if lane != record.lane and seen:
                    before = first_done.get((lane, int(seen), done.rank))
                    if before is not None:
                        yield before, done
        for done in record.first_done().values():
            for applied in record.applied:
                yield done, applied


def message_pairs(sources: dict[str, list[Entry]]) -> Iterable[tuple[Entry, Entry]]:
    """(msg.send, msg.recv) of every ring message logged at both ends.

    A ring whose sequence numbers start again at 1 (a client slot taken anew) begins a
    new generation at both ends, so a receive never pairs with an older ring's send.
    """
    sent: dict[tuple[str, str, int, int], Entry] = {}
    for source, entries in sources.items():
        for key, entry in _numbered(source, entries, "msg.send"):
            sent.setdefault(key, entry)
    for source, entries in sources.items():
        for key, entry in _numbered(source, entries, "msg.recv"):
            send = sent.get(key)
            if send is not None:
                yield send, entry


def _numbered(
    source: str, entries: list[Entry], event: str
) -> Iterator[tuple[tuple[str, str, int, int], Entry]]:
    """``((sender, receiver, generation, seq), entry)`` of each ``event`` on a ring."""
    last: dict[str, int] = {}
    generation: dict[str, int] = defaultdict(int)
    for entry in entries:
        if entry.event != event:
            continue
        seq, peer = int(entry.get("seq") or 0), str(entry.get("peer"))
        if not seq:  # a timer or a message to itself
            continue
        if seq == 1 and last.get(peer, 0) >= 1:
            generation[peer] += 1
        last[peer] = seq
        ends = (source, peer) if event == "msg.send" else (peer, source)
        yield (*ends, generation[peer], seq), entry

"""A run's logs for replay: every actor's JSON lines, read and merged in happens-before order.

:func:`read_run` reads each ``<actor>-<rank>.jsonl`` of a run dir (docs/design.md, "Logs and
replay"; the events and fields are catalogued in ``runtime/events/``), skipping a
partial last line (a process killed mid-write) or any line that is not a JSON object
with a warning, and keeps only the last launch when the supervisor log shows several
on the same run dir. It gathers every numbered op of the three lanes into :class:`Op`
records (the engine's ``op.issue``, the executor's ``step.done``/``lane.done``, the
engine's application ``sched.step``/``sched.transfer`` or ``engine.stale``) and orders
all entries by the protocol's own happens-before:

- program order within each file;
- a ring message's ``msg.send`` before its ``msg.recv`` (same ring, same sequence number);
- an op's ``op.issue`` before each rank's completion of it, and every rank's before the
  engine applies it (docs/design.md, "Ranks (tensor parallelism)": the engine counts an op
  complete once every rank reported it);
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
from pathlib import Path
from typing import Any, Final

import orjson

from ringfence.actors.replay.records import LANE_ACTORS, LANE_NAMES, Entry, Op, RunLog

NOT_LOGS: Final = frozenset({"outputs.jsonl"})  # the run's results, not a log


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
    pid, starts = None, 0  # the process writing now, and the starts it logged so far
    for (number, _), value in zip(numbered, values, strict=True):
        if value is None:
            continue
        if not isinstance(value, dict) or not isinstance(value.get("event"), str):
            warnings.append(f"{path.name}:{number}: not a log event (no 'event'), skipped")
            continue
        entry = Entry(stem, number, value)
        if entry.pid != pid:
            pid, starts = entry.pid, 0
        if entry.event == "actor.start":
            starts += 1
        entry.life = (entry.pid, max(0, starts - 1))
        entries.append(entry)
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

"""A run's logs as replay holds them: each line an :class:`Entry`, each numbered op of the
three lanes an :class:`Op` (its issue, every rank's completions, the engine's application,
what each executor touched), and the whole run a :class:`RunLog` whose ``history`` is every
entry in happens-before order. Read and merged by ``log.py``; judged by ``checks.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
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


@dataclass(slots=True, eq=False)
class Entry:
    """One log line: where it came from and its fields (``data``, as written)."""

    source: str  # the log's file stem, "<actor>-<rank>" ("engine-0")
    line: int  # 1-based line number in that file
    data: dict[str, Any]
    order: int = -1  # position in the merged history (set by read_run)
    # Which life of its log's instance wrote it: (pid, n), n counting the instance's earlier
    # starts in that same process (a hosted instance restarts on a thread of its host's:
    # runtime/hosting.py). What the checks call an incarnation of the logging end.
    life: tuple[int, int] = (0, 0)
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

"""The life of one request in a run's logs: what ``ringfence replay RUN_DIR --request ID`` prints.

:func:`request_life` walks the merged history of :func:`.log.read_run` from the
request's ``request.arrive`` to its ``request.finish`` and keeps what concerns it, one line
each, prefixed with the time since its arrival (``+0.123s``):

- its arrival (sequence id, prompt tokens, max_tokens);
- every admission and resumption (tokens found cached per tier, tokens computed), prefetch
  (store op, blocks; then its completion: status, missing positions) and preemption
  (policy, computed tokens);
- the transfers of the rounds that hold one of its decisions, when they move its blocks: a
  swap-in into the block table of its piece in the round's step (or its next), a swap-out
  of its latest known block table, a write-back of the host blocks such a swap-out filled;
  each with its block count, status and time from issue to done;
- its steps: each prefill chunk, runs of decodes as one line, a step not finished ok alone;
- its finish (reason, output tokens, cached tokens, error), or that it was still in flight.

Decisions, transfers and steps are logged at trace level only; an info-level log gives the
arrival and the finish. Pure: reads nothing but the :class:`RunLog` it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

from ringfence.actors.replay.records import Entry, Op, RunLog

TOKENS_SHOWN: Final = 8  # tokens listed per run of decodes
IDS_SHOWN: Final = 5  # known request ids named when an id never arrived
TIERS: Final = ("device", "host", "storage")
TRACE_NOTE: Final = (
    "decisions, transfers and steps are logged at trace level only "
    "(launch with --set runtime.log_level=trace)"
)


def request_life(log: RunLog, request_id: str) -> list[str]:
    """The lines that tell ``request_id``'s life (see the module docstring).

    KeyError when no ``request.arrive`` names it.
    """
    arrivals = list(log.events("request.arrive", source="engine-0"))
    arrive = next((e for e in arrivals if e.get("request") == request_id), None)
    if arrive is None:
        known = list(dict.fromkeys(str(e.get("request")) for e in arrivals))
        shown = ", ".join(known[:IDS_SHOWN]) + (", ..." if len(known) > IDS_SHOWN else "")
        raise KeyError(
            f"request {request_id!r} never arrived in {log.run_dir}; "
            f"{len(known)} did: {shown or 'none'}"
        )
    life = _Life(log, arrive)
    life.header()
    if not log.traced:
        life.say(arrive, TRACE_NOTE)
    for entry in log.history[arrive.order + 1 :]:
        life.see(entry)
        if life.finished:
            break
    if not life.finished:
        life.say(log.history[-1], "still in flight at the end of the log")
    return life.lines


@dataclass(slots=True)
class _Decodes:
    """A run of consecutive decode steps, printed as one line."""

    at: Entry
    first: int
    last: int
    tokens: list[int] = field(default_factory=list)  # the first TOKENS_SHOWN sampled
    count: int = 0  # decode steps
    sampled: int = 0  # tokens they sampled


class _Life:
    def __init__(self, log: RunLog, arrive: Entry) -> None:
        self.log = log
        self.arrive = arrive
        self.request = str(arrive.get("request"))
        self.seq_id = int(arrive.get("seq_id"))
        self.prompt_tokens = int(arrive.get("prompt_tokens") or 0)
        self.lines: list[str] = []
        self.finished = False
        # A prefetch is done at its first completion, or with several ranks once the engine
        # applied it: every rank's (their missing positions together).
        one_rank = len(log.ranks("store")) == 1
        self.prefetch_done = ("lane.done", "sched.transfer") if one_rank else ("sched.transfer",)
        self.decodes: _Decodes | None = None
        self.table: list[int] = []  # its block table in its latest step so far
        self.prefetches: set[int] = set()  # store ops fetching for it, not yet done
        self.last_step = 0  # the latest step issued (anyone's)
        # Its block table in every step that holds a piece of it, by step number.
        self.tables: dict[int, list[int]] = {}
        for (lane, number), op in log.ops.items():
            piece = _piece(op, self.seq_id) if lane == "step" else None
            if piece is not None:
                self.tables[number] = list(piece[4])

    def say(self, at: Entry, text: str) -> None:
        self.flush()
        self.lines.append(f"+{at.ts - self.arrive.ts:.3f}s {text}")

    def flush(self) -> None:
        run, self.decodes = self.decodes, None
        if run is not None:
            steps = (
                f"step {run.first}" if run.first == run.last else f"steps {run.first}-{run.last}"
            )
            more = " ..." if run.sampled > len(run.tokens) else ""
            self.lines.append(
                f"+{run.at.ts - self.arrive.ts:.3f}s {steps}: {run.count} decode"
                f"{'s' if run.count != 1 else ''}, tokens {run.tokens}{more}"
            )

    def header(self) -> None:
        params: dict[str, Any] = {}
        for entry in self.log.events("sched.add", source="engine-0"):
            if entry.get("request") == self.request and entry.order < self.arrive.order:
                params = dict(entry.get("params") or {})
        max_tokens = self.arrive.get("max_tokens")
        if max_tokens is None:
            max_tokens = params.get("max_tokens")
        self.say(
            self.arrive,
            f"request {self.request} (seq {self.seq_id}) arrived: "
            f"{self.prompt_tokens} prompt tokens, max_tokens {max_tokens}",
        )

    def see(self, entry: Entry) -> None:
        event = entry.event
        if event == "request.finish" and entry.get("request") == self.request:
            cached = entry.get("cached_tokens") or {}
            tiers = " / ".join(f"{t} {cached.get(t, 0)}" for t in TIERS)
            error = entry.get("error")
            self.say(
                entry,
                f"finished: {entry.get('reason')}, {entry.get('output_tokens')} output tokens, "
                f"cached {tiers}" + (f", error: {error}" if error else ""),
            )
            self.finished = True
        elif event == "sched.abort" and entry.get("request") == self.request:
            self.say(entry, "aborted in the scheduler")
        elif event == "sched.schedule":
            self.round(entry)
        elif event == "op.issue" and entry.get("lane") == "step":
            self.step(entry)
        elif event in self.prefetch_done and entry.get("lane") == "store":
            number = int(entry.get("op"))
            if number in self.prefetches:
                self.prefetches.discard(number)
                op = self.log.ops.get(("store", number))
                missing = list(entry.get("missing") or ())
                self.say(
                    entry,
                    f"prefetch store op {number} done{_took(op)}: {entry.get('status')}, "
                    + (
                        f"{len(missing)} positions missing {missing}" if missing else "none missing"
                    ),
                )

    def round(self, entry: Entry) -> None:
        mine = [d for d in entry.get("decisions") or () if int(d[1]) == self.seq_id]
        if not mine:
            return
        for kind, _, detail in mine:
            self.say(entry, _decision(str(kind), detail))
            if kind == "prefetch":
                self.prefetches.add(int(detail["op"]))
        keys = [(str(lane), int(number)) for lane, number in entry.get("ops") or ()]
        step = next((n for lane, n in keys if lane == "step"), self.last_step + 1)
        later = [n for n in self.tables if n >= step]
        step_table = set(self.tables[min(later)]) if later else set()
        filled: set[int] = set()  # host blocks its swap-outs of this round wrote
        preempted = any(kind == "preempt" for kind, _, _ in mine)
        for key in keys:
            op = self.log.ops.get(key)
            if op is None or op.issue is None or op.lane == "step" or op.kind == "read":
                continue  # a prefetch is told by its decision and its completion
            device = [int(b) for b in op.issue.get("device_blocks") or ()]
            host = [int(b) for b in op.issue.get("host_blocks") or ()]
            if op.kind == "in":
                ours = sum(b in step_table for b in device)
            elif op.kind == "out" and preempted:  # else its blocks are not its own now
                pairs = [(d, h) for d, h in zip(device, host, strict=False) if d in self.table]
                filled.update(h for _, h in pairs)
                ours = len(pairs)
            elif op.kind == "write":
                ours = sum(b in filled for b in host)
            else:
                ours = 0
            if ours:
                self.say(entry, _transfer(op, ours, len(device) or len(host)))

    def step(self, entry: Entry) -> None:
        number = self.last_step = int(entry.get("op"))
        op = self.log.ops.get(("step", number))
        piece = _piece(op, self.seq_id) if op is not None else None
        if op is None or piece is None:
            return
        _, start, count, _, table = piece
        start, count, self.table = int(start), int(count), list(table)
        tokens = [
            int(token)
            for applied in op.applied[:1]
            for seq, token in applied.get("outputs") or ()
            if int(seq) == self.seq_id
        ]
        decode = count == 1 and start >= self.prompt_tokens
        what = (
            f"decode position {start}"
            if decode
            else f"prefill positions {start}-{start + count - 1}, {_blocks(len(table))}"
        )
        if op.status != "ok":
            error = op.done[0].get("error") if op.done else None
            status = op.status or "no completion logged"
            self.say(entry, f"step {number}: {what}: {status}" + (f" ({error})" if error else ""))
        elif decode:
            run = self.decodes
            if run is None:
                self.flush()
                run = self.decodes = _Decodes(entry, number, number)
            run.last = number
            run.count += 1
            run.sampled += len(tokens)
            run.tokens.extend(tokens[: max(TOKENS_SHOWN - len(run.tokens), 0)])
        else:
            sampled = f", first token {tokens[0]}" if tokens else ""
            self.say(entry, f"step {number}: {what}{sampled}")


def _piece(op: Op, seq_id: int) -> list[Any] | None:
    """The piece of ``seq_id`` in step ``op`` (as logged), or None."""
    if op.issue is None:
        return None
    for piece in op.issue.get("pieces") or ():
        if int(piece[0]) == seq_id:
            return list(piece)
    return None


def _decision(kind: str, detail: dict[str, Any]) -> str:
    if kind in ("admit", "resume"):
        tiers = " / ".join(f"{t} {detail.get(t, 0)}" for t in TIERS)
        verb = "admitted" if kind == "admit" else "resumed"
        return f"{verb}: cached {tiers} tokens, {detail.get('computed', 0)} computed"
    if kind == "prefetch":
        return f"prefetch: store op {detail.get('op')}, {_blocks(int(detail.get('blocks') or 0))}"
    if kind == "preempt":
        return f"preempted ({detail.get('policy')}): {detail.get('computed')} computed tokens"
    return f"{kind}: {detail}"


DIRECTIONS: Final = {"in": "swap-in", "out": "swap-out", "write": "write-back"}


def _transfer(op: Op, ours: int, total: int) -> str:
    reason = op.issue.get("reason") if op.issue is not None else None
    blocks = _blocks(total) if ours == total else f"{ours} of {_blocks(total)}"
    return (
        f"{DIRECTIONS.get(op.kind, op.kind)}"
        + (f" ({reason})" if reason else "")
        + f" {op.lane} op {op.number}: {blocks}, {op.status or 'no completion logged'}{_took(op)}"
    )


def _took(op: Op | None) -> str:
    """`` after 12.3 ms`` from the op's issue to its executor's completion, or ""."""
    if op is None or op.issue is None or not op.done:
        return ""
    return f" after {(op.done[0].ts - op.issue.ts) * 1e3:.1f} ms"


def _blocks(count: int) -> str:
    return f"{count} block{'' if count == 1 else 's'}"

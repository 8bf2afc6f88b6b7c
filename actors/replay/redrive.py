"""``ringfence replay --redrive``: repeat the engine's scheduler calls on a fresh scheduler.

The scheduler is pure and deterministic (sched/scheduler.py): the same calls in the
same order give the same ops. At trace level the engine logs every call it makes
into it (``sched.add``, ``sched.abort``, ``sched.schedule``, ``sched.step``,
``sched.transfer``, ``sched.reset``) and every answer the storage tier gave it
(``sched.storage``), in the order made. :func:`redrive` builds a scheduler from the
run dir's ``config.toml`` and the model limits (and first op numbers) of
``engine.ready``, makes the same calls in the same order,
answers its storage lookups from the log, and compares every decision with the
logged one: each round's ops (lane, number, fence, pieces and block tables, poison,
direction, reason, blocks) and decisions (admissions with their hits per tier,
prefetches, preemptions), each request's sequence id, and each finish (reason and
output tokens), and last the tokens the step results gave each request with the
run's ``outputs.jsonl``. It stops at the first difference. No model, no device, no storage:
a run dir copied to another machine redrives the same.

Each engine incarnation (a process id in ``engine-0.jsonl``) starts a fresh scheduler,
as the engine does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ringfence.actors.engine.begin import sched_config
from ringfence.actors.engine.config import EngineSettings
from ringfence.actors.engine.ledger import access_fields, issue_fields
from ringfence.actors.replay.records import Entry, RunLog
from ringfence.cache.fences import Lane
from ringfence.cache.ids import BlockHash
from ringfence.cache.storage.registry import NO_TIER
from ringfence.runtime.config import loads_config
from ringfence.sched.request import Request, RequestError, SamplingParams
from ringfence.sched.scheduler import Scheduler

CALLS = frozenset(
    {
        "engine.ready",
        "sched.add",
        "sched.abort",
        "sched.schedule",
        "sched.step",
        "sched.transfer",
        "sched.reset",
        "request.arrive",
        "request.finish",
    }
)


@dataclass(frozen=True, slots=True)
class Divergence:
    """The first decision of the fresh scheduler that differs from the logged one."""

    entry: Entry  # the logged call or decision
    message: str


@dataclass(frozen=True, slots=True)
class Redrive:
    """What was compared, and the first difference (None: every decision agreed)."""

    calls: int  # scheduler calls made
    rounds: int  # scheduling rounds compared
    ops: int  # ops compared field by field
    decisions: int  # admissions, prefetches and preemptions compared
    divergence: Divergence | None


class _Diverged(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class _LoggedAnswers:
    """The storage tier's logged answers, given back in order (``sched.storage``)."""

    def __init__(self, answers: Sequence[Entry]) -> None:
        self.answers = deque(answers)

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        if not self.answers:
            raise _Diverged(
                f"the scheduler asked storage about {len(keys)} blocks; the log has no more answers"
            )
        answer = self.answers.popleft()
        if int(answer.get("asked")) != len(keys):
            raise _Diverged(
                f"the scheduler asked storage about {len(keys)} blocks; the engine asked "
                f"about {answer.get('asked')} ({answer.where})"
            )
        return int(answer.get("found"))


def redrive(log: RunLog) -> Redrive:
    """Repeat the logged calls (see the module docstring); raises ValueError when the log
    was not written at trace level or the run dir has no config.toml."""
    if not log.traced:
        raise ValueError("redrive needs the engine's trace: run with runtime.log_level=trace")
    config_file = log.run_dir / "config.toml"
    if not config_file.is_file():
        raise ValueError(f"{config_file} is missing: the scheduler's settings are in it")
    # The Engine's sections of the run's config: the scheduler's settings are built of them.
    config = loads_config(config_file.read_text(), str(config_file)).sections(EngineSettings)
    state = _State(log, config)
    engine = log.sources.get("engine-0", [])
    lives = list(dict.fromkeys(e.life for e in engine))
    for life in lives:
        calls = [e for e in engine if e.life == life]
        state.begin([e for e in calls if e.event == "sched.storage"])
        for entry in calls:
            if entry.event not in CALLS:
                continue
            try:
                state.call(entry)
            except _Diverged as e:
                return state.result(Divergence(entry, e.message))
            except (RequestError, RuntimeError, KeyError, ValueError) as e:
                return state.result(
                    Divergence(entry, f"the scheduler raised {type(e).__name__}: {e}")
                )
    return state.result(state.outputs(log.run_dir / "outputs.jsonl"))


class _State:
    def __init__(self, log: RunLog, config: EngineSettings) -> None:
        self.log = log
        self.config = config
        self.scheduler: Scheduler | None = None
        self.storage: _LoggedAnswers | None = None
        self.requests: dict[str, Request] = {}
        self.added: dict[str, int | None] = {}  # request id -> seq id (None: refused)
        self.finishes: dict[str, Entry] = {}  # request id -> its request.finish
        self.calls = self.rounds = self.ops = self.decisions = 0

    def result(self, divergence: Divergence | None) -> Redrive:
        return Redrive(self.calls, self.rounds, self.ops, self.decisions, divergence)

    def begin(self, answers: Sequence[Entry]) -> None:
        """A new engine incarnation: a fresh scheduler once its engine.ready is reached."""
        self.scheduler = None
        self.storage = _LoggedAnswers(answers)
        self.requests.clear()
        self.added.clear()
        self.finishes.clear()

    def call(self, entry: Entry) -> None:
        event = entry.event
        if event == "engine.ready":
            settings = sched_config(
                self.config,
                str(entry.get("model_id")),
                int(entry.get("max_position")),
                int(entry.get("vocab_size") or 1 << 31),
            )
            backend = self.config.cache.storage.backend != NO_TIER
            first = {Lane(lane): int(n) for lane, n in (entry.get("first_ops") or {}).items()}
            self.scheduler = Scheduler(
                settings, self.storage if backend else None, journal=True, first_numbers=first
            )
            return
        scheduler = self.scheduler
        if scheduler is None:
            raise _Diverged(f"{event} before engine.ready: no scheduler yet")
        self.calls += event.startswith("sched.")
        if event == "sched.add":
            self._add(scheduler, entry)
        elif event == "request.arrive":
            rid = str(entry.get("request"))
            if self.added.get(rid) != entry.get("seq_id"):
                raise _Diverged(
                    f"request {rid} got sequence id {self.added.get(rid)}; the engine's was "
                    f"{entry.get('seq_id')}"
                )
        elif event == "sched.abort":
            scheduler.abort(str(entry.get("request")))
        elif event == "sched.schedule":
            self._schedule(scheduler, entry)
        elif event == "sched.step":
            outputs = [(int(s), int(t)) for s, t in entry.get("outputs") or ()]
            scheduler.on_step(int(entry.get("step")), str(entry.get("status")), outputs)
        elif event == "sched.transfer":
            lane = Lane(str(entry.get("lane")))
            missing = [int(m) for m in entry.get("missing") or ()]
            scheduler.on_transfer(lane, int(entry.get("op")), str(entry.get("status")), missing)
        elif event == "sched.reset":
            scheduler.reset_device()
        elif event == "request.finish":
            self._finish(entry)

    def _add(self, scheduler: Scheduler, entry: Entry) -> None:
        rid = str(entry.get("request"))
        params = SamplingParams(**(entry.get("params") or {}))
        request = Request(
            request_id=rid,
            prompt_token_ids=entry.get("prompt"),
            params=params,
            cache_salt=str(entry.get("cache_salt") or ""),
        )
        try:
            self.added[rid] = scheduler.add(request)
        except RequestError:
            self.added[rid] = None  # refused here as by the engine, if no arrive follows
        self.requests[rid] = request

    def _schedule(self, scheduler: Scheduler, entry: Entry) -> None:
        self.rounds += 1
        ops = scheduler.schedule()
        got = [[str(op.lane), op.number] for op in ops]
        logged = entry.get("ops") or []
        if got != logged:
            raise _Diverged(f"the round issued {_json(got)}; the engine's issued {_json(logged)}")
        decisions = _plain([list(d) for d in scheduler.take_decisions()])
        if decisions != (entry.get("decisions") or []):
            raise _Diverged(
                f"the round decided {_json(decisions)}; the engine's decided "
                f"{_json(entry.get('decisions'))}"
            )
        self.decisions += len(decisions)
        for op in ops:
            record = self.log.ops.get((str(op.lane), op.number))
            access = scheduler.take_access(op)
            if record is None or record.issue is None:
                continue  # never sent before the log ended
            self.ops += 1
            expected = issue_fields(op)
            if access is not None and record.issue.get("declared") is not None:
                expected["declared"] = access_fields(access)  # logs before it have none
            for key, value in expected.items():
                if record.issue.get(key) != value:
                    raise _Diverged(
                        f"{op.lane} op {op.number}: {key} {_json(value)}; the engine's was "
                        f"{_json(record.issue.get(key))} ({record.issue.where})"
                    )

    def outputs(self, path: Path) -> Divergence | None:
        """The first request whose tokens in ``outputs.jsonl`` (a workload run's results)
        are not the tokens the logged step results gave it."""
        if not path.is_file():
            return None
        for raw in path.read_bytes().splitlines():
            line = orjson.loads(raw)
            request = self.requests.get(str(line.get("id")))
            finish = self.finishes.get(str(line.get("id")))
            got = list(request.output_token_ids) if request is not None else None
            if finish is not None and got != line.get("token_ids"):
                return Divergence(
                    finish,
                    f"request {line.get('id')}: the logged step results gave it {_json(got)}; "
                    f"{path.name} has {_json(line.get('token_ids'))}",
                )
        return None

    def _finish(self, entry: Entry) -> None:
        rid = str(entry.get("request"))
        request = self.requests.get(rid)
        self.finishes[rid] = entry
        if request is None:
            raise _Diverged(f"request {rid} finished, but it was never added")
        reason = str(request.finish_reason or "abort")
        logged = (entry.get("reason"), entry.get("output_tokens"))
        if (reason, request.num_output_tokens) != logged:
            raise _Diverged(
                f"request {rid} ended {reason} with {request.num_output_tokens} tokens; the "
                f"engine's ended {logged[0]} with {logged[1]}"
            )


def _plain(value: object) -> Any:
    """``value`` as the log holds it (JSON types only)."""
    return orjson.loads(orjson.dumps(value))


def _json(value: object) -> str:
    text = orjson.dumps(value).decode()
    return text if len(text) <= 240 else text[:237] + "..."

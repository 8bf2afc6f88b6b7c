"""Faults injected into real runs, and what each run lost: the matrix of ``ringfence bench faults``.

The scenarios are in :mod:`ringfence.actors.tools.bench.faults.matrix`; the client faults in
:mod:`ringfence.actors.tools.bench.faults.clients`, the storage faults in
:mod:`ringfence.actors.tools.bench.faults.storage`. A :class:`Scenario` launches
``ringfence launch`` on a workload (in its own session, so nothing of it outlives a
timeout), injects its faults while the run goes on, and judges the run against the plain
in-process loop with no tiers on the same model
(:class:`ringfence.actors.tools.testing.local.LocalRunner`): an :class:`Outcome` says how
many requests completed, how many got a token that differs from the reference, whether the
run hung (ran past its deadline), how many shared-memory names it left, and whether
``ringfence replay`` (with ``--redrive`` on a traced run) passed on its logs.

The faults are SIGKILLs, each of one process this launch started (its pid is taken
from ``actors.json`` and checked to be a child of the launch's supervisor) once the
Worker has done a given step: a Transfer lane, the Worker, the Engine, or the
supervisor itself. A kill waits until the previous victim is back (its next
``actor.ready``), so each kill lands on a live process.

Waiting here is for another process tree's progress, which it publishes only in files
(its logs, ``actors.json``): the runner sleeps on inotify for the run dir and its parent
and on a pidfd for the launch (:mod:`ringfence.actors.tools.bench.faults.watch`), and after
each wake-up reads only what the logs gained. The exits of orphaned actors are waited
for on pidfds too.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import orjson

from ringfence.actors.tools.bench.faults.watch import FolderWatch
from ringfence.actors.tools.bench.launcher import Launched

SUPERVISOR = "supervisor-0"


class FaultError(RuntimeError):
    """The scenario could not be carried out (not the run's fault): e.g. a victim never came up."""


@dataclass(frozen=True, slots=True)
class Kill:
    """SIGKILL ``instance`` ("swap-0", "worker-0", "engine-0" or "supervisor-0") once the
    Worker has done step ``at_step`` (counted over all its incarnations)."""

    instance: str
    at_step: int


@dataclass(frozen=True, slots=True)
class Scenario:
    """One launch: a workload, its settings, the faults to inject, the exit status expected.

    ``prepare`` is a context around the launch (a storage tier to fill and damage, a
    server to run) that yields more settings. ``drive`` runs while the launch does: with
    ``serve``, the instance serves clients instead of running the workload, ``drive``
    plays them (the workload's requests are what it submits and judges), and the run is
    then stopped with SIGTERM.
    """

    name: str
    workload: str  # a synthetic workload
    requests: int
    sets: tuple[str, ...] = ()
    kills: tuple[Kill, ...] = ()
    expect_exit: int = 0  # 0: the workload completes; 1: the run ends (an actor gave up)
    exact: bool = True  # every completed request must have the reference's tokens
    prepare: Callable[[Path, Scenario], AbstractContextManager[tuple[str, ...]]] | None = None
    drive: Callable[[Launch, Scenario, Outcome], None] | None = None
    serve: bool = False


@dataclass(slots=True)
class Outcome:
    """What a scenario's run lost. ``replay`` is "ok", "FAIL: ..." or "skipped"."""

    fault: str
    injected: int = 0
    requests: int = 0
    completed: int = 0
    wrong_tokens: int = 0
    hangs: int = 0
    leaked_names: int = 0
    replay: str = "skipped"
    exit_code: int | None = None
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # what went wrong (none: as expected)
    info: list[str] = field(default_factory=list)  # what else was measured

    @property
    def ok(self) -> bool:
        return (
            not self.wrong_tokens
            and not self.hangs
            and not self.leaked_names
            and self.replay in ("ok", "skipped")
            and not self.notes
        )


# The model and tier settings every scenario shares: float64 so that the comparison with
# the plain loop is exact, chaos delays and poisoned blocks so that a missing fence shows.
MODEL = (
    "runtime.topology=ringfence.actors.engine:TOPOLOGY",
    "model.dtype=float64",
    "cache.block_size=16",
    "engine.progress=false",
    "engine.arrivals=false",
)
TIERS = (
    "cache.host_blocks=24",
    "cache.storage.backend=local",
    "cache.poison_freed=true",
    "transfer.chaos_delay_ms=2",
)
FAST = ("runtime.heartbeat_s=0.1", "runtime.stop_timeout_s=5.0")
TRACE = "runtime.log_level=trace"


@cache
def reference(workload: str, requests: int, model: tuple[str, ...] = MODEL) -> dict[str, list[int]]:
    """Each request's tokens from the plain loop: no tiers, a pool that never runs out."""
    from ringfence.actors.config import Config
    from ringfence.actors.engine.intake import load_workload
    from ringfence.actors.tools.testing.local import LocalRunner

    sets = [*model, "cache.host_blocks=0", "cache.storage.backend=none", "cache.device_blocks=1024"]
    config = Config.load(None, sets)
    lines = load_workload(f"synthetic:{workload}", requests=requests)
    return {r.id: list(r.token_ids) for r in LocalRunner(config).run(lines, arrivals=False)}


class Launch(Launched):
    """A launched run (:class:`Launched`: its own process group, a deadline) and what the
    faults read of its logs and do to its processes."""

    __slots__ = ("_read", "restarting", "watch")

    def __init__(self, run_dir: Path, sets: Sequence[str], *, timeout: float) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)  # watched before the launch writes in it
        super().__init__(run_dir, sets, timeout=timeout)
        self.restarting: tuple[str, int] | None = None  # the last victim, its incarnation
        self._read: dict[str, tuple[int, list[dict[str, Any]]]] = {}  # log: (bytes, lines)
        try:
            self.watch = FolderWatch([run_dir, run_dir.parent], self.proc.pid)
        except BaseException:
            super().close()  # nothing of the launch outlives a failed start
            raise

    def close(self) -> None:
        super().close()
        self.watch.close()

    def lines(self, log: str) -> list[dict[str, Any]]:
        """Every whole line of ``<log>.jsonl`` so far (a copy); reads only what it gained."""
        offset, lines = self._read.get(log, (0, []))
        try:
            with (self.run_dir / f"{log}.jsonl").open("rb") as f:
                f.seek(offset)
                data = f.read()
        except FileNotFoundError:
            return []
        whole = data.rfind(b"\n") + 1  # the last line may still be being written
        lines += [orjson.loads(line) for line in data[:whole].split(b"\n") if line]
        self._read[log] = (offset + whole, lines)
        return list(lines)

    def events(self, log: str, event: str) -> list[dict[str, Any]]:
        return [r for r in self.lines(log) if r.get("event") == event]

    def wait_for(self, what: str, ready: Callable[[], bool]) -> None:
        """Check ``ready`` after every change to the run's files, until the deadline; the
        launch's exit first is a FaultError."""
        while not ready():
            if self.proc.poll() is not None:
                raise FaultError(f"the run ended (status {self.proc.returncode}) before {what}")
            if self.remaining() <= 0:
                raise FaultError(f"no {what} before the deadline")
            self.watch.wait(self.remaining())

    def steps_done(self) -> int:
        return len(self.events("worker-0", "step.done"))

    def live_child(self, instance: str) -> tuple[int, int] | None:
        """The live process of ``instance`` and its incarnation (from actors.json, which the
        supervisor writes as it spawns one), if that process is this launch's: its child, or
        a child of its fork server (runtime/starter.py), itself its child."""
        rows = orjson.loads((self.run_dir / "actors.json").read_bytes())
        row = next(r for r in rows if r["id"] == instance)
        pid = row.get("pid")
        parent = None if pid is None else _parent(pid)
        if parent is None or self.proc.pid not in (parent, _parent(parent)):
            return None
        return int(pid), int(row["incarnation"])

    def ready_since(self, instance: str, incarnation: int) -> bool:
        """Whether the supervisor saw an incarnation of ``instance`` after ``incarnation``
        ready."""
        readies = self.events(SUPERVISOR, "actor.ready")
        return any(e["instance"] == instance and e["incarnation"] > incarnation for e in readies)

    def kill(self, kill: Kill) -> None:
        """SIGKILL the victim once the Worker has done the kill's steps. The victim is the
        live process actors.json names, not one the supervisor's log has called ready yet:
        that line can come late under load (0.6 s once, while a 212-step run ended first)."""
        self.wait_for(f"step {kill.at_step}", lambda: self.steps_done() >= kill.at_step)
        if kill.instance != SUPERVISOR:
            found: list[tuple[int, int]] = []

            def live() -> bool:
                child = self.live_child(kill.instance)
                found[:] = [] if child is None else [child]
                return child is not None

            self.wait_for(f"a live {kill.instance}", live)
            pid, incarnation = found[0]
            os.kill(pid, signal.SIGKILL)
            self.restarting = (kill.instance, incarnation)
        else:
            os.kill(self.proc.pid, signal.SIGKILL)

    def settle(self) -> None:
        """Wait until the last victim's next incarnation is ready: the next kill lands on a
        live process."""
        if self.restarting is not None:
            instance, killed = self.restarting
            self.wait_for(f"{instance} restarted", lambda: self.ready_since(instance, killed))
            self.restarting = None


def _parent(pid: int) -> int | None:
    """The parent pid of a live process, or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else int(fields[1])


def run_scenario(
    scenario: Scenario, folder: Path, *, timeout: float = 300.0, trace: bool = True
) -> Outcome:
    """Launch ``scenario`` in ``folder``, inject its faults, and judge the run."""
    with ExitStack() as stack:
        work = folder / scenario.name.replace(" ", "-").strip("()")
        extra = stack.enter_context(scenario.prepare(work, scenario)) if scenario.prepare else ()
        return _run(scenario, work / "run", (*scenario.sets, *extra), timeout, trace)


def _run(
    scenario: Scenario, run_dir: Path, extra: tuple[str, ...], timeout: float, trace: bool
) -> Outcome:
    sets = [*MODEL, *TIERS, *FAST, *([TRACE] if trace else [])]
    # The supervisor restarts each victim as often as it is killed (3 by default).
    victims = Counter(
        k.instance.rsplit("-", 1)[0] for k in scenario.kills if k.instance != SUPERVISOR
    )
    sets += [f"actors.{name}.max_restarts={max(3, n)}" for name, n in victims.items()]
    if not scenario.serve:
        sets += [f"engine.workload=synthetic:{scenario.workload}"]
        sets += [f"engine.requests={scenario.requests}"]
    sets += extra
    outcome = Outcome(scenario.name, requests=scenario.requests)
    supervisor_killed = bool(scenario.kills) and scenario.kills[-1].instance == SUPERVISOR
    with Launch(run_dir, sets, timeout=timeout) as launch:
        try:
            for kill in scenario.kills:
                launch.settle()
                launch.kill(kill)
                outcome.injected += 1
            if scenario.drive is not None:
                launch.wait_for(
                    "engine.ready", lambda: bool(launch.events("engine-0", "engine.ready"))
                )
                scenario.drive(launch, scenario, outcome)
                if scenario.serve:
                    launch.proc.send_signal(signal.SIGTERM)
            outcome.exit_code = launch.wait()  # None: it hung, and its group is killed
            if supervisor_killed:
                _orphans(launch, outcome)
            outcome.hangs = int(outcome.exit_code is None)
        except FaultError as e:
            outcome.notes.append(str(e))
    outcome.seconds = time.monotonic() - launch.started
    if supervisor_killed:
        launch.clean()  # what `ringfence clean RUN_DIR` does
    outcome.leaked_names = len(launch.clean())  # what the run left, unlinked now
    if outcome.exit_code != scenario.expect_exit and not outcome.hangs:
        outcome.notes.append(f"exit status {outcome.exit_code}, expected {scenario.expect_exit}")
    _judge_tokens(scenario, run_dir, outcome)
    _count_failures(launch, outcome)
    if trace and (run_dir / "engine-0.jsonl").is_file():
        outcome.replay = _replay(run_dir)
    return outcome


def _orphans(launch: Launch, outcome: Outcome) -> None:
    """After the supervisor's SIGKILL: its actors must exit by themselves, within seconds."""
    rows = orjson.loads((launch.run_dir / "actors.json").read_bytes())
    pids = [r["pid"] for r in rows if r.get("pid") and _parent(r["pid"]) is not None]
    started = time.monotonic()
    _wait_exits(pids, started + 10.0)
    outcome.info.append(f"its actors exited {time.monotonic() - started:.2f} s after it died")
    left = [pid for pid in pids if _alive(pid)]
    if left:
        outcome.hangs += 1
        outcome.notes.append(f"actors {left} still alive 10 s after the supervisor died")
        for pid in left:  # the launch's own children, by pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _wait_exits(pids: Sequence[int], deadline: float) -> None:
    """Sleep until every process of ``pids`` has exited, or the deadline. They are not our
    children (the supervisor that was their parent is dead), so each is waited on through
    a pidfd, which becomes readable when its process exits."""
    fds = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            fds.append(os.pidfd_open(pid))
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        waiting = len(fds)
        while waiting and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                waiting -= 1
    finally:
        for fd in fds:
            os.close(fd)


def _count_failures(launch: Launch, outcome: Outcome) -> None:
    """What the run reported failing or cancelled on its way, as information."""
    counts = []
    for log in ("worker-0", "swap-0", "store-0"):
        event = "step.done" if log == "worker-0" else "lane.done"
        statuses = [e.get("status") for e in launch.events(log, event)]
        bad = {s: statuses.count(s) for s in ("failed", "cancelled", "rejected") if s in statuses}
        counts += [f"{log.split('-')[0]} {status} {n}" for status, n in bad.items()]
    for event in ("storage.write_failed", "storage.unavailable", "engine.tier_reset"):
        n = len(launch.events("store-0", event) + launch.events("engine-0", event))
        if n:
            counts.append(f"{event} {n}")
    if counts:
        outcome.info.append("; ".join(counts))


def _alive(pid: int) -> bool:
    return _parent(pid) is not None


def _judge_tokens(scenario: Scenario, run_dir: Path, outcome: Outcome) -> None:
    path = run_dir / "outputs.jsonl"
    if not path.is_file():
        return
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines() if line]
    expected = reference(scenario.workload, scenario.requests)
    for line in lines:
        if line.get("finish_reason") in ("length", "stop"):
            outcome.completed += 1
            if scenario.exact and line["token_ids"] != expected.get(line["id"]):
                outcome.wrong_tokens += 1


def _replay(run_dir: Path) -> str:
    from ringfence.actors.replay.checks import check_run
    from ringfence.actors.replay.log import read_run
    from ringfence.actors.replay.redrive import redrive

    log = read_run(run_dir)
    result = check_run(log)
    if not result.ok:
        first = result.violations[0]
        return f"FAIL: [{first.check}] {first.message}"
    if log.traced:
        outcome = redrive(log)
        if outcome.divergence is not None:
            return f"FAIL: redrive: {outcome.divergence.message}"
    return "ok"


def workload_of(scenario: Scenario) -> list[Any]:
    """The requests of ``scenario``'s synthetic workload."""
    from ringfence.actors.engine.intake import load_workload

    return load_workload(f"synthetic:{scenario.workload}", requests=scenario.requests)


def kills(instance: str, *steps: int) -> tuple[Kill, ...]:
    return tuple(Kill(instance, step) for step in steps)


# The pressure workload with swap preemption keeps every lane busy: 4 requests need about
# 110 blocks of a 48-block pool.
PRESSURE = ("cache.device_blocks=48", "sched.preemption=swap")
SAVE = ("cache.device_blocks=48", "sched.preemption=save")
NEVER = "actors.engine.restart=never"

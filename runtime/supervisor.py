"""The supervisor (``ringfence launch``): creates a run, spawns and watches its actors, ends it.

A run, in order:

1. import and check the topology (every receiver handles its channels' messages),
   the per-actor config, its defaults (the machine's: the device pool on a GPU) and its
   preflight checks (the checkpoint, the workload), before anything is created;
2. take the run dir (cleaning what a dead earlier run left there), write the lease,
   the names manifest and the resolved config, then create every doorbell, ring and
   counter block the manifest names (run.py);
3. spawn every ``placement = "spawn"`` instance (forked from the fork server that imported
   the actors' modules, or from a fresh interpreter: ``runtime.start_method``, starter.py) and
   wait, with a deadline, for each one (and each external or hosted one: hosting.py) to
   report ready;
   an ``attach = "optional"`` instance (a client slot, see topology.py) is only
   awaited: it may attach at any time, or never;
4. watch: a child's exit (its process sentinel), a stale heartbeat or a missed ready
   deadline (the child is killed); a shutdown request from an actor; SIGINT/SIGTERM.
   What follows a fault (a restart alone or with its group, after a backoff, or giving
   up and ending the run) is restarts.py's. A failed child leaves a failure record
   (failure.py); the supervisor logs it with the exit and keeps the one that ended the
   run in :attr:`Supervisor.failure` for the command;
5. stop: a Stop on each actor's control ring in topology order, each awaited within
   the stop deadline (an attached optional instance is sent Stop, not awaited: its
   host process stops when it next polls), then SIGKILL for what is left; unlink
   every name; remove the lease. Step 5 runs on every exit path, errors included.

The supervisor sleeps on its own doorbell and never polls: actors ring it when
their ``ready``/``exited``/``shutdown`` watermarks move, a waker thread rings it
when a child exits or a signal arrives, and the wait's deadline is the next timer
(a heartbeat deadline, a restart backoff, the ready or stop deadline).
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ringfence.runtime import child
from ringfence.runtime.config import RunConfig
from ringfence.runtime.failure import Failure, read_failure
from ringfence.runtime.log import ActorLog, log_path
from ringfence.runtime.messages import RUNTIME, Stop
from ringfence.runtime.restarts import EXIT_FAILED, Restarts, attached
from ringfence.runtime.run import (
    Run,
    Slot,
    create_run,
    resolve,
    run_preflight,
    write_actors,
)
from ringfence.runtime.starter import Starter, modules_of
from ringfence.runtime.topology import SUPERVISOR
from ringfence.shm import names

REAP_TIMEOUT_S = 5.0  # a child whose sentinel fired is past its last Python code


class Supervisor:
    """Runs one launch. Main thread only (it installs signal handlers for its duration).

    The lifecycle of the run and its children (create, start, watch, stop, reap); it is
    the :class:`~ringfence.runtime.restarts.Lifecycle` its :class:`Restarts` act through.
    """

    def __init__(self, config: RunConfig, run_dir: Path | None = None) -> None:
        # Nothing exists yet: a topology, config or preflight error leaves nothing behind
        # (the fork server, started first so that its imports overlap the checks, is stopped).
        prepared = resolve(config)  # the machine's defaults in
        self.config, self.topology, self.notes = prepared
        self._starter = Starter(
            self.config.runtime.start_method,
            modules_of([actor.target for actor in self.topology.actors]),
        )
        try:
            # The preflight here (it reads files, not the actors' modules: a refused run is
            # refused in a moment), then the topology's check, which imports every actor's
            # module: in a fork of the server, whose imports are not this process's.
            run_preflight(self.config, self.topology)
            if self._starter.forks:
                timeout = self.config.runtime.ready_timeout_s
                self._starter.call(self.topology.check, (), timeout=timeout)
            else:
                self.topology.check()
        except BaseException:
            self._starter.close()
            raise
        self.run_id = names.new_run_id()
        self.run_dir = run_dir or Path(config.runtime.run_dir) / self.run_id
        # Replaced by the run's log once the run dir exists; until then lines go nowhere.
        self.log = ActorLog(None, actor=SUPERVISOR, rank=0, epoch=0)
        self.exit_code = 0
        self._stop_reason: str | None = None
        # Why the run failed, in lines for the terminal: the failure record of the actor
        # that ended it, or how its process ended when it left none.
        self.failure: list[str] = []
        self._by_sentinel: dict[int, Slot] = {}
        self._restarts = Restarts(self.config, self.topology, self)

    # Setup and teardown.

    def _create(self, stack: ExitStack) -> Run:
        run, stale = create_run(stack, self.config, self.topology, self.run_id, self.run_dir)
        self.log = ActorLog(
            log_path(self.run_dir, SUPERVISOR, 0),
            actor=SUPERVISOR,
            rank=0,
            epoch=0,
            level=self.config.runtime.log_level,
        )
        stack.callback(self.log.close)
        if stale:
            self.log.info("run.clean", run_id=stale)
        if self.notes:
            self.log.info("run.resolve_defaults", notes=list(self.notes))
        return run

    def run(self) -> int:
        """Launch, supervise until stopped, tear down. Returns the process exit status."""
        from ringfence.runtime.waker import Waker

        started = time.monotonic()
        with ExitStack() as stack:
            stack.callback(self._starter.close)  # last: once every child was reaped
            run = self._create(stack)
            waker = Waker(run.bell)
            waker.start()
            stack.callback(waker.close)
            stack.callback(self._reap_all, run)
            self.log.info(
                "run.start",
                run_id=self.run_id,
                run_dir=str(self.run_dir),
                topology=self.config.runtime.topology,
                instances=[s.entry.id for s in run.slots],
            )
            try:
                for slot in run.slots:
                    self.start(run, slot, waker)
                self._supervise(run, waker)
                self._stop_all(run, waker)
            except BaseException as e:
                self.log.error(
                    "run.error", error=repr(e), exc_info=e if isinstance(e, Exception) else None
                )
                self.exit_code = EXIT_FAILED
                raise
            finally:
                write_actors(self.run_dir, run)
                self.log.info(
                    "run.end",
                    reason=self._stop_reason,
                    exit_code=self.exit_code,
                    duration_s=round(time.monotonic() - started, 3),
                    names=len(run.manifest.names),
                )
        return self.exit_code

    # Starting and watching.

    def start(self, run: Run, slot: Slot, waker: Any) -> None:
        """Spawn ``slot``'s child under its next incarnation (an external one: await its
        next attach), with a ready deadline; ``waker`` watches the child's sentinel."""
        now = time.monotonic()
        slot.state, slot.started_at = "starting", now
        slot.deadline = now + self.config.runtime.ready_timeout_s
        if slot.entry.attach == "optional":
            slot.deadline = math.inf  # may attach at any time, or never
        if slot.entry.placement != "spawn":  # external or hosted: attached, not spawned
            slot.incarnation = slot.control.next_incarnation()
            self.log.info("actor.await", instance=slot.entry.id, incarnation=slot.incarnation)
            if slot.entry.placement == "hosted":  # its host attaches it once told (hosting.py)
                slot.control.wanted.advance(slot.incarnation)
            write_actors(self.run_dir, run)
            return
        slot.incarnation += 1
        slot.kill_reason = None
        spec = child.ChildSpec(
            str(self.run_dir),
            slot.entry.name,
            slot.entry.rank,
            slot.incarnation,
            threads=self.config.actor(slot.entry.name).threads,
        )
        proc = self._starter.process(child.main, (spec,), name=f"rf-{slot.entry.id}")
        proc.start()
        slot.proc, slot.pid, slot.exitcode = proc, proc.pid, None
        self._by_sentinel[proc.sentinel] = slot
        waker.watch([proc.sentinel])
        self.log.info(
            "actor.spawn",
            instance=slot.entry.id,
            instance_pid=proc.pid,
            incarnation=slot.incarnation,
        )
        write_actors(self.run_dir, run)

    @staticmethod
    def _marks(run: Run) -> list[int]:
        return [
            mark.value()
            for s in run.slots
            for mark in (s.control.ready, s.control.exited, s.control.shutdown, s.control.failed)
        ]

    def _next_deadline(self, run: Run) -> float:
        timeout = self.config.runtime.heartbeat_timeout_s
        wake = [time.monotonic() + timeout]
        for s in run.slots:
            if s.state in ("starting", "restarting"):
                wake.append(s.deadline)  # math.inf for a rank of a group restart
            elif s.state == "ready":
                wake.append(s.beat_at + timeout)
        return min(*wake, *self._restarts.wakes(run.slots))

    def _supervise(self, run: Run, waker: Any) -> None:
        while True:
            self._collect(run, waker)
            if self._stop_reason is not None:
                return
            marks = self._marks(run)

            def moved(marks: list[int] = marks) -> bool:
                return waker.pending or self._marks(run) != marks

            remaining = self._next_deadline(run) - time.monotonic()
            if remaining > 0:
                run.bell.wait_until(moved, remaining)

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    def begin_stop(self, reason: str, exit_code: int) -> None:
        """End the run for ``reason``; the first reason and its exit status win."""
        if self._stop_reason is None:
            self._stop_reason = reason
            self.exit_code = exit_code

    def _collect(self, run: Run, waker: Any) -> None:
        signals, fired = waker.take()
        for signum in signals:
            name = signal.Signals(signum).name
            self.log.info("run.signal", signal=name)
            self.begin_stop(f"signal {name}", 128 + signum)
        self._reap_fired(run, fired)
        now = time.monotonic()
        for slot in run.slots:
            ctl = slot.control
            if slot.state == "starting" and ctl.ready.value() >= slot.incarnation:
                slot.state, slot.beat, slot.beat_at = "ready", ctl.heartbeat.value(), now
                slot.ever_ready = True
                if slot.entry.placement != "spawn":  # external or hosted: attached, not spawned
                    writer = ctl.ready.writer()
                    slot.pid = writer.pid if writer else None
                self.log.info(
                    "actor.ready",
                    instance=slot.entry.id,
                    instance_pid=slot.pid,
                    incarnation=slot.incarnation,
                    startup_s=round(now - slot.started_at, 3),
                )
                write_actors(self.run_dir, run)
            if slot.live and ctl.failed.value() >= slot.incarnation:  # a hosted one failed
                self._guest_failed(run, slot)
            if ctl.shutdown.value() > slot.shutdowns:
                slot.shutdowns = ctl.shutdown.value()
                self.begin_stop(f"shutdown requested by {slot.entry.id}", 0)
            if slot.state == "ready":
                self._restarts.check_heartbeat(run, slot, now)
            elif slot.state == "starting" and now > slot.deadline:
                self._restarts.late(slot)
            elif slot.state == "restarting" and now >= slot.deadline and self._stop_reason is None:
                self.start(run, slot, waker)
        if self._stop_reason is None:
            self._restarts.respawn_groups(run, waker, now)
        # Optional slots wait for attaches forever: only the required actors keep a run alive.
        required = [s for s in run.slots if s.entry.attach == "required"]
        if (
            self._stop_reason is None
            and required
            and not any(s.live or s.state == "restarting" for s in required)
        ):
            self.begin_stop("every actor exited", 0)

    def kill(self, slot: Slot, reason: str) -> None:
        """SIGKILL a child this supervisor spawned, by its own pid; its exit is collected later."""
        if slot.proc is not None and slot.proc.is_alive() and slot.pid is not None:
            self.log.warning(
                "actor.kill", instance=slot.entry.id, instance_pid=slot.pid, reason=reason
            )
            os.kill(slot.pid, signal.SIGKILL)
            slot.kill_reason = slot.kill_reason or reason

    def _reap_fired(self, run: Run, sentinels: set[int]) -> None:
        """Collect the children whose sentinels fired (their exit status follows shortly)."""
        for fd in sentinels:
            slot = self._by_sentinel.pop(fd, None)
            if slot is not None and slot.proc is not None:
                slot.proc.join(REAP_TIMEOUT_S)
                self._exited(run, slot)

    def _exited(self, run: Run, slot: Slot, *, close: bool = True) -> None:
        """Record a child's exit (already joined). ``close=False`` leaves its sentinel open for
        a waker that may not have seen it fire yet (the sentinel's fd number must not be
        reused while the waker still watches it)."""
        code = slot.proc.exitcode
        if close:
            slot.proc.close()
        slot.proc, slot.exitcode = None, code
        clean = code == 0 and slot.control.exited.value() >= slot.incarnation
        failure = self._log_exit(slot, code, clean)
        if self._stop_reason is not None:
            slot.state = "stopped"
        elif slot.state == "restarting":
            pass  # killed for its group's restart (groups.py): no failure of its own
        elif clean:
            slot.state = "exited"
        else:
            self._restarts.failed(run, slot, failure)
        write_actors(self.run_dir, run)

    def _guest_failed(self, run: Run, slot: Slot) -> None:
        """A hosted instance failed in its host's process, which lives on: recorded as a
        child's exit is, then restarted alone under its own policy (its host attaches the
        next incarnation once :meth:`start` marks it wanted)."""
        failure = self._log_exit(slot, None, False)
        if self._stop_reason is not None:
            slot.state = "stopped"
        else:
            self._restarts.failed(run, slot, failure)
        write_actors(self.run_dir, run)

    def _log_exit(self, slot: Slot, code: int | None, clean: bool) -> Failure | None:
        """Log the end of ``slot``'s incarnation (``code``: its process's exit status, None
        for a hosted one whose host lives on) with the record it left; return the record."""
        failure = None if clean else read_failure(self.run_dir, slot.entry.id, slot.incarnation)
        self.log.info(
            "actor.exit",
            instance=slot.entry.id,
            instance_pid=slot.pid,
            exitcode=code,
            incarnation=slot.incarnation,
            clean=clean,
            where=None if failure is None else failure.where,
            at=None if failure is None else failure.at,
            error=None if failure is None else f"{failure.error}: {failure.message}",
        )
        return failure

    # Stopping.

    def _stop_all(self, run: Run, waker: Any) -> None:
        assert self._stop_reason is not None
        rt = self.config.runtime
        deadline = time.monotonic() + rt.stop_timeout_s
        self.log.info("run.stop", reason=self._stop_reason, stop_timeout_s=rt.stop_timeout_s)
        cut_short: str | None = None
        for spec in self.topology.actors:
            group = [s for s in run.slots if s.entry.name == spec.name and s.state == "ready"]
            kind, payload = RUNTIME.encode(Stop(reason=self._stop_reason))
            for slot in group:
                slot.writer.put(kind, payload, timeout=1.0)
            if spec.attach == "optional":
                # Told, not awaited: a user's process may be busy elsewhere and handles the
                # Stop when it next polls; nothing of the run waits on it.
                for slot in group:
                    slot.state = "stopped"
                continue
            cut_short = self._await_exit(run, group, waker, deadline)
            if cut_short is not None:
                break
        for slot in run.slots:
            if slot.state in ("starting", "restarting"):
                slot.state = "stopped"
            self.kill(slot, cut_short if slot.state == "ready" and cut_short else "run stopped")
        for slot in run.slots:  # what was killed: collected here, so the record is complete
            if slot.proc is not None:
                self._by_sentinel.pop(slot.proc.sentinel, None)
                slot.proc.join(REAP_TIMEOUT_S)
                self._exited(run, slot, close=False)

    def _await_exit(
        self, run: Run, group: Sequence[Slot], waker: Any, deadline: float
    ) -> str | None:
        """Wait until every slot of ``group`` has exited: None; else why the wait was cut short."""

        def exited() -> bool:
            return all(
                s.proc is None
                if s.entry.placement == "spawn"
                else s.control.exited.value() >= s.incarnation
                or s.control.failed.value() >= s.incarnation  # a hosted one, in its host
                or not attached(s.control.ready.writer())
                for s in group
            )

        while True:
            signals, fired = waker.take()
            self._reap_fired(run, fired)
            finished = exited()  # not waker.pending: an exit not yet collected is no exit
            for slot in group:
                if slot.entry.placement != "spawn" and slot.live and finished:
                    slot.state = "stopped"
                    clean = slot.control.exited.value() >= slot.incarnation
                    self.log.info(
                        "actor.detach", instance=slot.entry.id, instance_pid=slot.pid, clean=clean
                    )
            if signals:
                name = signal.Signals(signals[0]).name
                self.log.info("run.signal", signal=name, during="stop")
                return f"stop cut short by {name}"
            if finished:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "stop deadline passed"
            run.bell.wait_until(lambda: waker.pending or exited(), remaining)

    def _reap_all(self, run: Run) -> None:
        """Last step on every exit path: no child of this run outlives the supervisor."""
        for slot in run.slots:
            if slot.proc is not None:
                self.kill(slot, "supervisor exiting")
                slot.proc.join(REAP_TIMEOUT_S)
                slot.exitcode = slot.proc.exitcode
                slot.proc = None  # not closed: the waker may still hold its sentinel

"""Restarts: what the supervisor does about a child that failed, hung or came up late.

The faults, as the supervisor's watch loop finds them:

- a child that stops beating its heartbeat for ``runtime.heartbeat_timeout_s`` is
  SIGKILLed (one the supervisor spawned), or its host process is (a hosted one,
  runtime/hosting.py), or it is warned about once a timeout (an external one: not ours to
  kill); an external or hosted one that exits or dies is detached and awaited again;
- a child not ready within ``runtime.ready_timeout_s`` is SIGKILLed; an external one
  that did not attach in time fails the run;
- a child that exited with a failure is restarted under its actor's policy
  (``restart``, ``max_restarts``, ``backoff_s`` doubling up to ``backoff_max_s``): alone,
  with the run epoch bumped, or with every rank of a ``restart_together`` actor
  (groups.py). An instance whose start raised before it ever reported ready is not
  restarted (it would meet the same error again): it gives up at once, as an actor past
  its ``max_restarts`` does, and giving up records the failure's lines and stops the run.

Owned by the :class:`~ringfence.runtime.supervisor.Supervisor` (main thread); it mutates
the slots it is handed (state, deadline, restart count) and the run's epoch counter, and
acts through the :class:`Lifecycle` its owner implements. A fresh spawn, a kill and the
end of the run stay the owner's.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

from ringfence.runtime.config import RunConfig
from ringfence.runtime.failure import Failure, describe_exit
from ringfence.runtime.groups import KILL_REAP_S, Groups, ranks_of
from ringfence.runtime.log import ActorLog
from ringfence.runtime.run import Run, Slot
from ringfence.runtime.topology import Topology
from ringfence.shm.liveness import ProcessStamp

EXIT_FAILED = 1  # the run's exit status when an actor gave up


class Lifecycle(Protocol):
    """What restarts ask of the supervisor that owns them."""

    log: ActorLog  # the run's supervisor log
    failure: list[str]  # why the run failed, in lines for the terminal

    def start(self, run: Run, slot: Slot, waker: Any) -> None:
        """Spawn ``slot``'s child again (or await an external one's next attach)."""

    def kill(self, slot: Slot, reason: str) -> None:
        """SIGKILL ``slot``'s child if this supervisor spawned it and it is alive."""

    def begin_stop(self, reason: str, exit_code: int) -> None:
        """End the run for ``reason``; the first reason and its exit status win."""


class Restarts:
    """The restart policy and the fault checks, applied to the slots of one run."""

    def __init__(self, config: RunConfig, topology: Topology, owner: Lifecycle) -> None:
        self._config = config
        self._owner = owner
        self._groups = Groups(topology)

    @property
    def _log(self) -> ActorLog:
        return self._owner.log  # read at each use: the owner replaces it once the run exists

    def wakes(self, slots: Sequence[Slot]) -> list[float]:
        """When each group restart under way next needs a look (its reap deadline, then the
        end of its backoff)."""
        return list(self._groups.wakes(slots))

    def check_heartbeat(self, run: Run, slot: Slot, now: float) -> None:
        """Look at a ready ``slot`` at ``now``: detach an external child that exited or died,
        take a new heartbeat, or act on a stale one (kill ours, warn about an external one)."""
        ctl = slot.control
        if slot.entry.placement != "spawn" and (
            ctl.exited.value() >= slot.incarnation or not attached(ctl.ready.writer())
        ):
            clean = ctl.exited.value() >= slot.incarnation
            self._log.info(
                "actor.detach", instance=slot.entry.id, instance_pid=slot.pid, clean=clean
            )
            self._owner.start(run, slot, None)  # wait for the next attach
            return
        beat = ctl.heartbeat.value()
        if beat != slot.beat:
            slot.beat, slot.beat_at = beat, now
            return
        age = now - slot.beat_at
        if age <= self._config.runtime.heartbeat_timeout_s:
            return
        self._log.warning(
            "actor.hung",
            instance=slot.entry.id,
            instance_pid=slot.pid,
            heartbeat_age_s=round(age, 3),
        )
        if slot.entry.placement == "hosted":  # its host's process is ours: kill that
            host = next(s for s in run.slots if s.entry.id == slot.entry.host)
            self._owner.kill(host, f"hosted {slot.entry.id}'s heartbeat stale")
            if host.state == "ready":
                host.state = "killing"  # as for its own stale beat: its exit comes through
            slot.beat_at = now  # it detaches once that process is gone
        elif slot.entry.placement == "external":
            slot.beat_at = now  # not ours to kill; warn once per timeout
        else:
            self._owner.kill(slot, "heartbeat stale")
            slot.state = "killing"  # no more checks: its exit comes through the waker

    def late(self, slot: Slot) -> None:
        """``slot`` missed its ready deadline: kill ours (its exit decides what follows); an
        external or hosted one that never attached fails the run."""
        timeout = self._config.runtime.ready_timeout_s
        self._log.error(
            "actor.late", instance=slot.entry.id, instance_pid=slot.pid, ready_timeout_s=timeout
        )
        if slot.entry.placement != "spawn":
            slot.state = "failed"
            self._owner.begin_stop(f"{slot.entry.id} did not attach within {timeout}s", EXIT_FAILED)
        else:
            self._owner.kill(slot, "not ready in time")
            slot.state = "killing"

    def failed(self, run: Run, slot: Slot, failure: Failure | None) -> None:
        """``slot``'s child exited unclean (``failure``: the record it left, if any): restart
        it, alone or with its group, after its backoff, or give up and stop the run."""
        policy = self._config.actor(slot.entry.name)
        # A start that raised would raise again; one cut short (late, killed) may yet succeed.
        start_raised = failure is not None and not slot.ever_ready
        if policy.restart == "never" or slot.restarts >= policy.max_restarts or start_raised:
            slot.state = "failed"
            self._log.error(
                "actor.gave_up",
                instance=slot.entry.id,
                restarts=slot.restarts,
                restart=policy.restart,
                ever_ready=slot.ever_ready,
            )
            if failure is not None:
                self._owner.failure = failure.lines()
            else:
                said = describe_exit(slot.entry.id, slot.exitcode)
                self._owner.failure = [f"{said} ({slot.kill_reason})" if slot.kill_reason else said]
            self._owner.begin_stop(f"{slot.entry.id} failed", EXIT_FAILED)
            return
        backoff = min(policy.backoff_s * 2**slot.restarts, policy.backoff_max_s)
        if self._groups.together(slot):
            self._restart_group(run, slot, backoff)
            return
        slot.restarts += 1
        slot.state, slot.deadline = "restarting", time.monotonic() + backoff
        epoch = run.control[0]
        epoch.advance(epoch.value() + 1)
        self._log.info(
            "actor.restart",
            instance=slot.entry.id,
            restarts=slot.restarts,
            backoff_s=backoff,
            new_epoch=epoch.value(),
        )

    def _restart_group(self, run: Run, slot: Slot, backoff: float) -> None:
        """``slot``, a rank of a restart_together actor, failed: kill the other ranks and
        respawn every rank once all have exited (groups.py). One event, one epoch bump."""
        running = self._groups.begin(run.slots, slot, backoff=backoff, now=time.monotonic())
        epoch = run.control[0]
        epoch.advance(epoch.value() + 1)
        self._log.info(
            "actor.group_restart",
            group=slot.entry.name,
            instance=slot.entry.id,
            siblings=[s.entry.id for s in ranks_of(run.slots, slot.entry.name) if s is not slot],
            killed=[s.entry.id for s in running],
            restarts=slot.restarts,
            backoff_s=backoff,
            new_epoch=epoch.value(),
        )
        for sibling in running:
            self._owner.kill(sibling, f"group restart: {slot.entry.id} failed")

    def respawn_groups(self, run: Run, waker: Any, now: float) -> None:
        """Spawn every group whose old ranks have all exited and whose backoff has passed,
        all ranks under one incarnation; stop the run if a killed rank outlived its kill."""
        ready, stuck = self._groups.due(run.slots, now)
        for ranks in ready:
            for rank in ranks:
                self._owner.start(run, rank, waker)
            incarnations = {rank.incarnation for rank in ranks}
            assert len(incarnations) == 1, f"a group spawned under {incarnations}"
        if stuck:
            ids, group = [s.entry.id for s in stuck], stuck[0].entry.name
            self._log.error(
                "actor.group_stuck", group=group, instances=ids, reap_timeout_s=KILL_REAP_S
            )
            self._owner.failure = [f"{', '.join(ids)} still alive {KILL_REAP_S}s after SIGKILL"]
            self._owner.begin_stop(f"group {group} could not restart", EXIT_FAILED)


def attached(stamp: ProcessStamp | None) -> bool:
    """Whether the process that stamped a control watermark is still alive."""
    return stamp is not None and stamp.is_alive()

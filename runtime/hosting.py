"""Hosted actors: an actor run on a thread of another actor's process, rank for rank.

``[actors.<name>] placement = "hosted"`` with ``host = "<other>"`` runs each rank of
``name`` inside the process of the same rank of ``other``, which the supervisor spawns
as usual. Why: actors that share a device share its context only inside one process. A
lane that copies KV blocks in the Worker's own process queues its copies on a stream of
the Worker's CUDA context, where they can run beside the model's kernels, instead of
time-slicing the GPU with a context of its own.

Nothing of the protocol changes. A hosted instance keeps its own doorbell, rings,
control watermarks, log and incarnations; it is attached exactly as a user's process
attaches an external one (``embed.attach``), and its driver runs on a thread of its own
(:class:`Guests`). The supervisor treats it as an instance it did not spawn: it awaits
its attach and sees it detach when the process that attached it is gone.

Fate is shared, so a failure is always one the supervisor already handles:

- the host process dies (a crash, a SIGKILL): its guests die with it; the supervisor
  restarts the host under its policy, and the host's next process attaches them again
  as their next incarnations;
- a guest fails (its start, its loop or its stop raised): the process records the
  guest's failure and the host's (naming the guest), and exits with status 1, so the
  host is restarted, and the guest with it;
- a guest whose heartbeat goes stale gets its host process killed (the supervisor
  spawned that one) rather than a warning as an external one would;
- the host stops as asked: it stops its guests first and waits for them, so they exit
  cleanly before the supervisor's stop order reaches them.

The topology's check (:func:`check_hosts`) refuses a host that is not an actor of the
run, itself, hosted or external in turn, optional, or of another rank count, naming the
key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ringfence.runtime.manifest import read_manifest
from ringfence.shm.errors import ConfigError

if TYPE_CHECKING:
    from ringfence.runtime.config import RunConfig
    from ringfence.runtime.driver import Driver
    from ringfence.runtime.topology import Topology

# What a guest's failure does to its process (the child's: record it, exit 1).
OnFailure = Callable[["Guest", str, BaseException], None]


def check_hosts(config: RunConfig, topology: Topology) -> None:
    """Raise ConfigError naming the key for a hosted actor whose host cannot run it, and
    for a ``host`` given to an actor that is not hosted."""
    specs = {a.name: a for a in topology.actors}
    for spec in topology.actors:
        policy = config.actor(spec.name)
        key = f"actors.{spec.name}"
        if policy.placement != "hosted":
            if policy.host:
                raise ConfigError(
                    f"{key}.host is read only with placement = 'hosted' (it is "
                    f"{policy.placement!r})",
                    key=f"{key}.host",
                )
            continue
        problem = ""
        host = specs.get(policy.host)
        if spec.attach != "required":
            problem = f"{spec.name} is attached at will by outside processes"
        elif not policy.host:
            problem = "placement 'hosted' needs a host: the actor whose process runs it"
        elif host is None:
            problem = f"{policy.host!r} is no actor of the run ({', '.join(sorted(specs))})"
        elif host.name == spec.name:
            problem = "an actor cannot host itself"
        elif host.attach != "required" or config.actor(host.name).placement != "spawn":
            problem = f"the host {host.name} must be spawned by the supervisor"
        elif host.ranks != spec.ranks:
            problem = (
                f"{spec.name} has {spec.ranks} ranks and its host {host.name} {host.ranks}: "
                "each rank is hosted by the same rank"
            )
        if problem:
            raise ConfigError(f"{key}.host: {problem}", key=f"{key}.host")


def hosts_of(config: RunConfig, topology: Topology) -> Mapping[str, str]:
    """Each hosted actor's name -> its host's name."""
    return {
        a.name: config.actor(a.name).host
        for a in topology.actors
        if config.actor(a.name).placement == "hosted"
    }


@dataclass(slots=True)
class Guest:
    """One hosted instance: its driver and the thread it runs on."""

    id: str  # "swap-0"
    driver: Driver
    thread: threading.Thread | None = None

    @property
    def incarnation(self) -> int:
        return self.driver.ctx.incarnation


class Guests:
    """The instances one process hosts beside its own actor, each on its own thread.

    Made and used by the process's main thread (``runtime/child.py``); a guest's thread
    only runs its driver and, if that raises, calls ``on_failure`` from there.
    """

    def __init__(self, guests: list[Guest]) -> None:
        self.guests = guests

    @classmethod
    def attach(cls, run_dir: str | Path, host: str) -> Guests:
        """Attach every instance of the run placed on ``host`` (an instance id such as
        ``"worker-0"``); none attached if any fails (the error propagates)."""
        from ringfence.runtime.embed import attach

        manifest = read_manifest(run_dir)
        guests: list[Guest] = []
        with ExitStack() as stack:
            for entry in manifest.instances:
                if entry.host != host:
                    continue
                driver = attach(run_dir, entry.name, entry.rank, placement="hosted")
                stack.callback(driver.close)
                guests.append(Guest(entry.id, driver))
            stack.pop_all()
        return cls(guests)

    def start(self, on_failure: OnFailure) -> None:
        """Run each guest on a thread; ``on_failure(guest, where, error)`` when one fails."""
        for guest in self.guests:

            def body(guest: Guest = guest) -> None:
                try:
                    guest.driver.run()
                except BaseException as e:  # logged by its driver; the process shares it
                    on_failure(guest, guest.driver.failed_in or "loop", e)

            guest.thread = threading.Thread(target=body, name=f"ringfence-{guest.id}", daemon=True)
            guest.thread.start()

    def stop(self, reason: str, timeout: float) -> list[str]:
        """Stop every guest and wait up to ``timeout`` seconds in all; the ids of those
        still running then (their process is about to end under them)."""
        import time

        for guest in self.guests:
            guest.driver.stop(reason)
        deadline = time.monotonic() + timeout
        left = []
        for guest in self.guests:
            if guest.thread is None:
                guest.driver.close()
                continue
            guest.thread.join(max(0.0, deadline - time.monotonic()))
            if guest.thread.is_alive():
                left.append(guest.id)
        return left

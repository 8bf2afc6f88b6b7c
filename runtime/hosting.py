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
its attach and sees it detach.

It is still its own actor: it fails and is restarted on its own, and its host lives on.
What cannot be done on a thread is done to the process:

- a guest fails (its attach, its start, its loop or its stop raised): its host's process
  writes the guest's failure record and then its ``failed`` mark (control.py), and keeps
  running. The supervisor applies the guest's restart policy as to a child of its own
  (backoff, the epoch, a give-up that stops the run with the record's lines), then marks
  the next incarnation ``wanted``; the guest's thread, waiting on the guest's own doorbell,
  attaches that incarnation and runs it. Its host's steps, model and device tier are
  untouched;
- the host process dies (a crash, a SIGKILL): its guests die with it and detach; the
  supervisor restarts the host under its policy, marks each guest's next incarnation
  wanted, and the host's next process attaches them;
- a guest whose heartbeat goes stale gets its host process killed (the supervisor spawned
  that one): a thread cannot be killed;
- the host stops as asked: it stops its guests first and waits for them, so they exit
  cleanly before the supervisor's stop order reaches them.

The topology's check (:func:`check_hosts`) refuses a host that is not an actor of the
run, itself, hosted or external in turn, optional, or of another rank count, and a guest
whose ranks restart together (a group restart kills processes), naming the key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from ringfence.runtime.config import load_config
from ringfence.runtime.control import InstanceControl
from ringfence.runtime.embed import CONFIG_FILE, attach
from ringfence.runtime.failure import record_failure
from ringfence.runtime.manifest import InstanceEntry, read_manifest
from ringfence.shm.counter import CounterBlock
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.errors import ConfigError

if TYPE_CHECKING:
    from ringfence.runtime.config import RunConfig
    from ringfence.runtime.driver import Driver
    from ringfence.runtime.topology import Topology

# What the host does when it cannot keep a guest (the child's: record it, exit 1).
OnLost = Callable[["Guest", BaseException], None]


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
        elif spec.restart_together:
            problem = (
                f"{spec.name}'s ranks restart together, which takes each rank's process down; "
                "a hosted one is restarted alone in its host's"
            )
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


class Guest:
    """One hosted instance: where it is, and the driver of its incarnation attached now."""

    def __init__(self, entry: InstanceEntry, control: InstanceControl, bell: Doorbell) -> None:
        self.entry = entry
        self.control = control  # its marks, through the host's own handle of the block
        self.bell = bell  # its own doorbell, which its host waits on while it is detached
        self.driver: Driver | None = None
        self.thread: threading.Thread | None = None

    @property
    def id(self) -> str:
        return self.entry.id


class Guests:
    """The instances one process hosts beside its own actor, each kept on a thread of its own.

    Made and stopped by the process's main thread (``runtime/child.py``). A guest's thread
    attaches each incarnation the supervisor marks wanted, runs it, and on its failure
    writes its record and its ``failed`` mark, then waits for the next (see the module doc).
    What the thread itself cannot do (a wait for the supervisor that outlived every deadline
    it has) goes to ``on_lost``, which ends the process.
    """

    def __init__(self, run_dir: Path, host: str, stack: ExitStack) -> None:
        self.run_dir = run_dir
        self._stack = stack
        self._lock = threading.Lock()
        self._stopping = False
        manifest = read_manifest(run_dir)
        config = load_config(run_dir / CONFIG_FILE)
        rt = config.runtime
        block = CounterBlock.attach(manifest.control)
        stack.callback(block.close)
        supervisor = Doorbell.attach(manifest.supervisor_bell, spin_us=rt.spin_us)
        stack.callback(supervisor.close)
        self.guests: list[Guest] = []
        self._waits: dict[str, float] = {}
        for entry in manifest.instances:
            if entry.host != host:
                continue
            control = InstanceControl.of(block, entry.index)
            control.failed.claim(notify=(supervisor,))
            bell = Doorbell.attach(entry.bell, spin_us=rt.spin_us)
            stack.callback(bell.close)
            self.guests.append(Guest(entry, control, bell))
            # The longest the supervisor may take to want the next incarnation: a restart's
            # backoff, or a stop of the run (the host's Stop ends the wait) after a give-up.
            policy = config.actor(entry.name)
            self._waits[entry.id] = (
                policy.backoff_max_s
                + rt.heartbeat_timeout_s
                + rt.ready_timeout_s
                + rt.stop_timeout_s
            )

    @classmethod
    def open(cls, run_dir: str | Path, host: str) -> Guests:
        """The guests of the run placed on ``host`` (an instance id such as ``"worker-0"``),
        none attached yet: :meth:`start` attaches each as the supervisor asks."""
        with ExitStack() as stack:
            guests = cls(Path(run_dir), host, stack)
            guests._stack = stack.pop_all()
        return guests

    def start(self, on_lost: OnLost) -> None:
        """Keep each guest on a thread: attach, run, and after a failure attach again."""
        for guest in self.guests:
            guest.thread = threading.Thread(
                target=self._keep,
                args=(guest, on_lost),
                name=f"ringfence-{guest.id}",
                daemon=True,
            )
            guest.thread.start()

    def _keep(self, guest: Guest, on_lost: OnLost) -> None:
        """The guest's thread: each incarnation the supervisor wants, until the host stops."""
        ctl = guest.control
        while True:
            incarnation = ctl.next_incarnation()

            def told(n: int = incarnation) -> bool:
                return self._stopping or ctl.wanted.value() >= n

            wanted = guest.bell.wait_until(told, self._waits[guest.id])
            if self._stopping:
                return
            if not wanted:
                on_lost(
                    guest,
                    TimeoutError(
                        f"the supervisor did not want incarnation {incarnation} of "
                        f"{guest.id} within {self._waits[guest.id]:.0f}s"
                    ),
                )
                return
            self._run(guest, incarnation)

    def _run(self, guest: Guest, incarnation: int) -> None:
        """Attach ``incarnation`` of ``guest`` and run it to its end; a failure is recorded
        and marked for the supervisor, which decides whether another incarnation follows."""
        where = "attach"
        try:
            driver = attach(
                self.run_dir,
                guest.entry.name,
                guest.entry.rank,
                placement="hosted",
                incarnation=incarnation,
            )
            with self._lock:
                if self._stopping:  # the host stops: this incarnation never starts
                    driver.close()
                    return
                guest.driver = driver
            where = "loop"
            try:
                driver.run()
            finally:
                where = driver.failed_in or where
                with self._lock:
                    guest.driver = None
        except BaseException as e:  # logged by its driver; the process lives on
            record_failure(self.run_dir, guest.id, incarnation, where, e)
            guest.control.failed.advance(incarnation)

    def stop(self, reason: str, timeout: float) -> list[str]:
        """Stop every guest and wait up to ``timeout`` seconds in all; the ids of those
        still running then (their process is about to end under them)."""
        import time

        with self._lock:
            self._stopping = True
            drivers = [g.driver for g in self.guests if g.driver is not None]
        for driver in drivers:
            driver.stop(reason)
        for guest in self.guests:
            guest.bell.ring()  # a thread waiting for its guest's next incarnation wakes
        deadline = time.monotonic() + timeout
        left = []
        for guest in self.guests:
            if guest.thread is None:
                continue
            guest.thread.join(max(0.0, deadline - time.monotonic()))
            if guest.thread.is_alive():
                left.append(guest.id)
        if not left:
            self._stack.close()
        return left

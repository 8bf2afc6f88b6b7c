"""A whole run inside the test process: the run's names made as the supervisor makes them,
every actor attached as an embedding host attaches one, each driven by its own thread.

:func:`inproc_run` creates the run dir and every shared-memory name of the topology the
settings name (``create_run``, the supervisor's own code), then attaches each instance
(``attach``, what a spawned child does) with the class the topology names or one given
in ``classes``, and runs its driver in a thread. Client slots are left free for
:class:`~ringfence.actors.client.client.Client`. Nothing is spawned, so a test can reach into a
live actor (to make it a fuzzing peer) and pays no process start-up. The test process
plays the supervisor: its doorbell is rung when an instance asks for shutdown. On the
way out every driver is stopped and joined, then every name of the run is removed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ringfence.actors.client.client import Client
from ringfence.actors.config import Config
from ringfence.runtime.actor import Actor
from ringfence.runtime.driver import Driver
from ringfence.runtime.embed import attach
from ringfence.runtime.run import Run, create_run, load_topology
from ringfence.shm import names

JOIN_TIMEOUT_S = 30.0  # an engine stopping may wait for the store lane's writes


@dataclass
class InprocRun:
    """A running in-process run; ``drivers`` by instance id ("engine-0")."""

    run_dir: Path
    run: Run
    drivers: dict[str, Driver]

    def actor(self, instance: str) -> Any:
        return self.drivers[instance].actor

    def shutdown_asked(self) -> bool:
        """True once any instance asked to end the run (a workload done)."""
        return any(slot.control.shutdown.value() for slot in self.run.slots)

    def wait_shutdown(self, timeout: float) -> bool:
        """Sleep on the supervisor's doorbell until an instance asks for shutdown."""
        return self.run.bell.wait_until(self.shutdown_asked, timeout)

    def failures(self) -> dict[str, BaseException]:
        """What ended any instance abnormally, by instance."""
        return {i: d.error for i, d in self.drivers.items() if d.error is not None}


def _stop(driver: Driver, running: set[str]) -> None:
    if driver.ctx.instance not in running:  # attached, never started
        driver.close()
        return
    driver.stop("test over")
    if not driver.join(JOIN_TIMEOUT_S):
        raise TimeoutError(f"{driver.ctx.instance} did not stop within {JOIN_TIMEOUT_S}s")


@contextmanager
def inproc_run(
    run_dir: Path, settings: tuple[str, ...], *, classes: Mapping[str, type[Actor]] = {}
) -> Iterator[InprocRun]:
    """Run the topology of ``settings`` in this process; see the module docstring."""
    config = Config.load(None, settings)
    topology = load_topology(config)
    run_id = names.new_run_id()
    with ExitStack() as stack:
        run, _ = create_run(stack, config, topology, run_id, run_dir)
        drivers: dict[str, Driver] = {}
        running: set[str] = set()
        # Attached last to first, so that they stop first to last (the stack unwinds in
        # reverse): the engine stops before the executors it sends to, as in a launch.
        for entry in reversed(run.manifest.instances):
            if entry.attach == "optional":
                continue
            driver = attach(
                run_dir,
                entry.name,
                entry.rank,
                actor_cls=classes.get(entry.name),
                placement="local",
            )
            stack.callback(_stop, driver, running)
            drivers[entry.id] = driver
        for entry in run.manifest.instances:
            if entry.id in drivers:
                # on_start here, one actor at a time: the two lanes both create the host tier,
                # and kvspace makes it under a name private to the process, not the thread.
                drivers[entry.id].start()
                drivers[entry.id].start_thread()
                running.add(entry.id)
        yield InprocRun(run_dir, run, drivers)


def wait_until_begun(client: Client, timeout: float) -> None:
    """Wait for a Stats of the engine whose scheduler has begun (its executors all answered):
    a Submit before then is refused as "starting". ``client`` was connected with stats."""
    deadline = time.monotonic() + timeout
    stats = client.stats(timeout=timeout)
    while stats is None or not stats.began:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"the engine's scheduler did not begin within {timeout} s"
        stats = client.stats(timeout=remaining, fresh=True)  # the next tick's

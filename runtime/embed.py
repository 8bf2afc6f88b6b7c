"""Attaching an actor instance to a launched run: used by spawned children and by host processes.

A host process embeds an actor of a running instance (one the config marks
``placement = "external"``) with::

    driver = attach(run_dir, "sink")         # rank 0; imports the class from the manifest
    driver.run()                             # or driver.start_thread(), or driver.poll(t)

The driver reads the run's manifest and resolved config, attaches the instance's
doorbell, rings, counter blocks and control watermarks, and opens its log at
``<run dir>/<name>-<rank>.jsonl``. It installs no signal handlers and never exits
the process; it stops on the supervisor's Stop, on ``driver.stop()``, or when the
supervisor is gone. Closing it releases every endpoint, so the instance can be
attached again (a new incarnation).
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path

from ringfence.runtime.actor import Actor, config_of
from ringfence.runtime.codec import Registry
from ringfence.runtime.config import load_config
from ringfence.runtime.control import InstanceControl
from ringfence.runtime.driver import Driver
from ringfence.runtime.imports import import_target
from ringfence.runtime.log import ActorLog, log_path
from ringfence.runtime.mailbox import Mailbox, RingInbox, RingOutbox
from ringfence.runtime.manifest import read_manifest
from ringfence.shm.counter import CounterBlock
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.liveness import ProcessStamp
from ringfence.shm.ring import Ring
from ringfence.shm.ring_reader import RingReader
from ringfence.shm.ring_writer import RingWriter

CONFIG_FILE = "config.toml"


def _registry(path: str) -> Registry:
    registry = import_target(path)
    if not isinstance(registry, Registry):
        raise ValueError(f"{path} is not a codec Registry")
    return registry


def attach(
    run_dir: str | os.PathLike[str],
    name: str,
    rank: int = 0,
    *,
    actor_cls: type[Actor] | None = None,
    placement: str = "external",
    incarnation: int | None = None,
) -> Driver:
    """A driver for instance ``name-rank`` of the run in ``run_dir``, attached and ready to run.

    ``actor_cls`` defaults to the class the topology names. ``incarnation`` defaults to
    one past the last one that reported ready. Raises ValueError for a run dir or
    instance that does not exist, ConfigError (a ValueError) naming the actor for a section
    it declares that the run's config lacks, EndpointTaken if a live process holds the
    instance.
    """
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    entry = manifest.instance(name, rank)
    config = load_config(run_dir / CONFIG_FILE)
    if actor_cls is None:
        target = import_target(entry.target)
        if not (isinstance(target, type) and issubclass(target, Actor)):
            raise ValueError(f"{entry.target} is not an Actor subclass")
        actor_cls = target
    section = config_of(actor_cls, config)  # only the sections it declares
    spin_us = config.runtime.spin_us
    with ExitStack() as stack:
        bell = Doorbell.attach(entry.bell, spin_us=spin_us)
        stack.callback(bell.close)
        peer_bells: dict[str, Doorbell] = {}

        def peer_bell(posix: str) -> Doorbell:
            if posix not in peer_bells:
                peer_bells[posix] = Doorbell.attach(posix, spin_us=spin_us)
                stack.callback(peer_bells[posix].close)
            return peer_bells[posix]

        def ring(posix: str) -> Ring:
            opened = Ring.attach(posix)
            stack.callback(opened.close)
            return opened

        control_block = CounterBlock.attach(manifest.control)
        stack.callback(control_block.close)
        counters = {c.name: CounterBlock.attach(c.posix) for c in manifest.counters}
        for block in counters.values():
            stack.callback(block.close)
        inboxes, outboxes = [], []
        for ep in entry.inboxes:
            reader = RingReader(ring(ep.ring), bell=bell, space=peer_bell(ep.peer_bell))
            stack.callback(reader.close)
            inboxes.append(RingInbox(ep.peer, reader, _registry(ep.protocol)))
        for ep in entry.outboxes:
            writer = RingWriter(ring(ep.ring), wake=peer_bell(ep.peer_bell), space=bell)
            stack.callback(writer.close)
            outboxes.append(RingOutbox(ep.peer, writer, _registry(ep.protocol)))
        control = InstanceControl.of(control_block, entry.index)
        control.claim([peer_bell(manifest.supervisor_bell)])
        if incarnation is None:
            incarnation = control.ready.value() + 1
        log = ActorLog(
            log_path(run_dir, name, rank),
            actor=name,
            rank=rank,
            epoch=control.epoch.value(),
            level=config.runtime.log_level,
        )
        stack.callback(log.close)
        resources = [bell, control_block, *counters.values(), *peer_bells.values()]
        # Rings are closed by the mailbox after their endpoints (resources close in reverse).
        resources += [ep.reader.ring for ep in inboxes] + [ep.writer.ring for ep in outboxes]
        mailbox = Mailbox(bell, inboxes, outboxes, resources)
        driver = Driver(
            actor_cls,
            name=name,
            rank=rank,
            mailbox=mailbox,
            runtime=config.runtime,
            log=log,
            config=section,
            run_id=manifest.run_id,
            run_dir=run_dir,
            placement=placement,
            incarnation=incarnation,
            counters=counters,
            control=control,
            supervisor=ProcessStamp(
                pid=manifest.supervisor_pid, start_ticks=manifest.supervisor_start_ticks
            ),
            bells={inst.id: inst.bell for inst in manifest.instances},
        )
        stack.pop_all()  # the driver owns everything now
    return driver

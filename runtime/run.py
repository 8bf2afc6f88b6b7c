"""The objects of one launched run: its dir, its shared-memory names, and a slot per instance.

:func:`create_run` takes the run dir (cleaning what a dead earlier run left there),
writes the lease, the names manifest and the resolved config, then creates every
doorbell, ring and counter block the manifest names, registering each one's close
and unlink on the caller's ExitStack, so that every exit path removes every name.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import orjson

from ringfence.runtime.config import RunConfig, check_actor_names, dump_config
from ringfence.runtime.control import InstanceControl, control_count
from ringfence.runtime.embed import CONFIG_FILE
from ringfence.runtime.hosting import check_hosts, hosts_of
from ringfence.runtime.imports import import_target
from ringfence.runtime.manifest import (
    MANIFEST_FILE,
    InstanceEntry,
    Manifest,
    build_manifest,
    read_manifest,
    write_atomic,
    write_manifest,
)
from ringfence.runtime.topology import Resolved, Topology
from ringfence.shm import names
from ringfence.shm.counter import CounterBlock
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.liveness import ProcessStamp
from ringfence.shm.ring import Ring
from ringfence.shm.ring_writer import RingWriter

ACTORS_FILE = "actors.json"


@dataclass(slots=True)
class Slot:
    """The supervisor's view of one instance."""

    entry: InstanceEntry
    control: InstanceControl
    writer: RingWriter  # the control ring to it
    proc: Any = None  # the multiprocess.Process of a spawned instance
    pid: int | None = None
    incarnation: int = 0  # the one spawned (or expected to attach) last
    restarts: int = 0
    state: str = "starting"  # starting, ready, killing, restarting, exited, failed, stopped
    exitcode: int | None = None
    # Ready deadline while starting; restart time while restarting (math.inf for a rank of
    # a group restart: the group's is kept by groups.py).
    deadline: float = 0.0
    beat: int = -1  # last heartbeat value seen ...
    beat_at: float = 0.0  # ... and when it was first seen
    started_at: float = 0.0
    shutdowns: int = 0  # shutdown requests seen so far
    ever_ready: bool = False  # some incarnation reported ready (only then is a restart tried)
    kill_reason: str | None = None  # why the supervisor killed the current incarnation

    @property
    def live(self) -> bool:
        return self.state in ("starting", "ready", "killing")


@dataclass
class Run:
    manifest: Manifest
    bell: Doorbell
    control: CounterBlock
    slots: list[Slot] = field(default_factory=list)


def load_topology(config: RunConfig, *, preflight: bool = False) -> Topology:
    """The topology ``runtime.topology`` names: a :class:`Topology`, or a function that
    builds one from the run's config (the fenced topology takes its ranks from it).

    With ``preflight``, its preflight checks run first (:func:`run_preflight`), before
    the actors' modules are imported: a run they refuse is refused in a moment."""
    topology = _topology_of(config)
    if preflight:
        run_preflight(config, topology)
    topology.check()
    return topology


class Prepared(NamedTuple):
    """A run's config with the machine's defaults filled in, its topology (not yet checked:
    the supervisor checks it next), and the notes saying which defaults were chosen and why."""

    config: RunConfig
    topology: Topology
    notes: tuple[str, ...]


def resolve(config: RunConfig) -> Prepared:
    """What the supervisor launches: the topology ``runtime.topology`` names, and ``config``
    with its defaults resolved (:func:`resolve_defaults`); no actor's module is imported.
    The supervisor then runs the preflight (:func:`run_preflight`) and the topology's check."""
    topology = _topology_of(config)
    config, notes = resolve_defaults(config, topology)
    return Prepared(config, topology, notes)


def _topology_of(config: RunConfig) -> Topology:
    found = import_target(config.runtime.topology)
    topology = found(config) if callable(found) else found
    if not isinstance(topology, Topology):
        raise ValueError(f"runtime.topology: {config.runtime.topology} is not a Topology")
    check_actor_names(config, [a.name for a in topology.actors], "config")
    check_hosts(config, topology)
    return topology


def resolve_defaults(config: RunConfig, topology: Topology) -> Resolved:
    """Each of the topology's defaults functions applied to ``config`` in order; their notes
    together. A ValueError (a setting that cannot fit the machine) propagates."""
    notes: list[str] = []
    for path in topology.defaults:
        fill = import_target(path)
        if not callable(fill):
            raise ValueError(f"topology: defaults function {path} is not a function")
        resolved = fill(config)
        if not isinstance(resolved, Resolved):
            raise TypeError(f"topology: defaults function {path} returned no Resolved")
        config = resolved.config
        notes += resolved.notes
    return Resolved(config, tuple(notes))


def run_preflight(config: RunConfig, topology: Topology) -> None:
    """Run each of the topology's preflight checks on ``config``, in order; the first
    ValueError (naming the file and the field at fault) propagates."""
    for path in topology.preflight:
        check = import_target(path)
        if not callable(check):
            raise ValueError(f"topology: preflight check {path} is not a function")
        check(config)


def prepare_run_dir(run_dir: Path) -> str | None:
    """Make ``run_dir`` usable; if a dead run left names there, remove them. Returns its id."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"run dir {run_dir} exists and is not a directory")
    if not (run_dir / MANIFEST_FILE).exists():
        try:
            # 0700: its logs, manifests and stored blocks are no other user's to read.
            run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"run dir {run_dir}: cannot create it: {e.strerror}") from e
        return None
    old = read_manifest(run_dir)
    if names.run_is_live(old.run_id):
        raise ValueError(f"run dir {run_dir} belongs to live run {old.run_id}")
    names.clean_run(old.run_id)
    return old.run_id


def create_run(
    stack: ExitStack, config: RunConfig, topology: Topology, run_id: str, run_dir: Path
) -> tuple[Run, str | None]:
    """Everything a run needs, made; and the id of a dead run whose names were cleaned first."""
    rt = config.runtime
    stale = prepare_run_dir(run_dir)
    stamp = ProcessStamp.current()
    placements = {a.name: config.actor(a.name).placement for a in topology.actors}
    manifest = build_manifest(
        run_id,
        topology,
        placements=placements,
        hosts=hosts_of(config, topology),
        ring_bytes=rt.ring_bytes,
        supervisor_pid=stamp.pid,
        supervisor_start_ticks=stamp.start_ticks,
    )
    names.write_lease(run_id)
    stack.callback(names.remove_lease, run_id)
    stack.callback(names.clean_run, run_id)  # whatever an error left half-made
    write_manifest(run_dir, manifest)
    (run_dir / CONFIG_FILE).write_text(dump_config(config))

    def made(obj: Any) -> Any:
        stack.callback(obj.unlink)
        stack.callback(obj.close)
        return obj

    bell = made(Doorbell.create(manifest.supervisor_bell, spin_us=0))
    control = made(CounterBlock.create(manifest.control, control_count(len(manifest.instances))))
    control[0].claim()
    for counter in manifest.counters:
        made(CounterBlock.create(counter.posix, counter.count))
    for entry in manifest.instances:
        made(Doorbell.create(entry.bell, spin_us=0))
    run = Run(manifest, bell, control)
    for entry in manifest.instances:
        rings = [made(Ring.create(ep.ring, ep.capacity)) for ep in entry.inboxes]
        peer = Doorbell.attach(entry.bell, spin_us=0)
        stack.callback(peer.close)
        writer = RingWriter(rings[0], wake=peer, space=bell)  # inboxes[0]: the control ring
        stack.callback(writer.close)
        inst = InstanceControl.of(control, entry.index)
        inst.wanted.claim(notify=(peer,))  # a hosted instance's host waits on its own bell
        run.slots.append(Slot(entry=entry, control=inst, writer=writer))
    return run, stale


def write_actors(run_dir: Path, run: Run) -> None:
    """``actors.json``: each instance's pid, incarnation, restarts and state, replaced whole."""
    rows = [
        {
            "id": s.entry.id,
            "name": s.entry.name,
            "rank": s.entry.rank,
            "placement": s.entry.placement,
            "attach": s.entry.attach,
            "pid": s.pid,
            "incarnation": s.incarnation,
            "restarts": s.restarts,
            "state": s.state,
            "exitcode": s.exitcode,
        }
        for s in run.slots
    ]
    write_atomic(run_dir / ACTORS_FILE, orjson.dumps(rows, option=orjson.OPT_INDENT_2))

"""The names manifest of a run (``<run dir>/names.json``): every shared-memory name and its role.

The supervisor derives the manifest from the topology before it creates anything
and writes it first, so ``ringfence clean RUN_DIR`` finds the run even if the
supervisor was killed halfway. Spawned actors and embedded ones read it to attach:
it tells each instance its doorbell, its inboxes (the supervisor's control ring
first) and outboxes, with the peer's doorbell and the channel's protocol. It is
JSON, decoded strictly by the wire codec, so a damaged file is an error naming the
field, never a half-attached actor.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import orjson

from ringfence.runtime.codec import Registry, make_kind, message
from ringfence.runtime.topology import SUPERVISOR, Attach, Instance, Topology
from ringfence.shm import names
from ringfence.shm.errors import ProtocolError

MANIFEST_FILE = "names.json"
CONTROL_PROTOCOL = "ringfence.runtime.messages:RUNTIME"
CONTROL_RING_BYTES = 4096
SUPERVISOR_INSTANCE = Instance(SUPERVISOR, 0)

_FILES = Registry("names.json")


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoint:
    peer: str  # the instance at the other end, e.g. "relay-0" or "supervisor-0"
    ring: str  # POSIX name of the ring
    peer_bell: str  # the other end's doorbell (rung on publish, or when room frees up)
    protocol: str  # import path of the channel's codec Registry
    capacity: int  # ring data bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class InstanceEntry:
    id: str  # "<name>-<rank>"
    name: str
    rank: int
    index: int  # position in the control block (see control.py)
    target: str  # import path of the Actor subclass
    placement: str  # "spawn", "external" (always for an optional actor) or "hosted"
    attach: Attach = "required"  # "optional": a slot processes attach to at will (topology.py)
    host: str = ""  # placement "hosted": the instance whose process runs it (hosting.py)
    bell: str  # POSIX name of its doorbell
    inboxes: tuple[Endpoint, ...]  # the supervisor's control ring first
    outboxes: tuple[Endpoint, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CounterEntry:
    name: str  # the topology's name for the block
    posix: str  # its POSIX name
    count: int


@message(_FILES, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    run_id: str
    supervisor_pid: int
    supervisor_start_ticks: int  # with the pid: tells a live supervisor from a recycled pid
    supervisor_bell: str
    control: str  # POSIX name of the control counter block
    counters: tuple[CounterEntry, ...]
    instances: tuple[InstanceEntry, ...]
    names: tuple[str, ...]  # every POSIX name of the run; a doorbell's names both appear once

    def instance(self, name: str, rank: int) -> InstanceEntry:
        for entry in self.instances:
            if entry.name == name and entry.rank == rank:
                return entry
        raise KeyError(
            f"run {self.run_id} has no instance {name}-{rank}; it has "
            f"{[e.id for e in self.instances]}"
        )


def build_manifest(
    run_id: str,
    topology: Topology,
    *,
    placements: Mapping[str, str],
    hosts: Mapping[str, str] | None = None,
    ring_bytes: int,
    supervisor_pid: int,
    supervisor_start_ticks: int,
) -> Manifest:
    """Name every object of a run of ``topology``. Pure: creates nothing.

    An optional actor's instances are placed "external" whatever ``placements`` says.
    ``hosts`` names each hosted actor's host (runtime/hosting.py): rank r of one is hosted
    by rank r of the other.
    """
    hosts = hosts or {}

    def bell(inst: Instance) -> str:
        return names.posix_name(run_id, f"bell.{inst.obj}")

    def ring(src: Instance, dst: Instance) -> str:
        return names.posix_name(run_id, f"ring.{src.obj}.{dst.obj}")

    def endpoint(peer: Instance, ring_name: str, protocol: str, capacity: int) -> Endpoint:
        return Endpoint(
            peer=peer.id, ring=ring_name, peer_bell=bell(peer), protocol=protocol, capacity=capacity
        )

    sup = SUPERVISOR_INSTANCE
    inboxes: dict[Instance, list[Endpoint]] = {}
    outboxes: dict[Instance, list[Endpoint]] = {}
    for inst in topology.instances():
        control_ring = endpoint(sup, ring(sup, inst), CONTROL_PROTOCOL, CONTROL_RING_BYTES)
        inboxes[inst], outboxes[inst] = [control_ring], []
    for link in topology.links():
        name = ring(link.src, link.dst)
        inboxes[link.dst].append(endpoint(link.src, name, link.protocol, ring_bytes))
        outboxes[link.src].append(endpoint(link.dst, name, link.protocol, ring_bytes))
    instances = tuple(
        InstanceEntry(
            id=inst.id,
            name=inst.name,
            rank=inst.rank,
            index=index,
            target=topology.actor(inst.name).target,
            placement=(
                "external"
                if topology.actor(inst.name).attach == "optional"
                else placements.get(inst.name, "spawn")
            ),
            attach=topology.actor(inst.name).attach,
            host=f"{hosts[inst.name]}-{inst.rank}" if inst.name in hosts else "",
            bell=bell(inst),
            inboxes=tuple(inboxes[inst]),
            outboxes=tuple(outboxes[inst]),
        )
        for index, inst in enumerate(topology.instances())
    )
    counters = tuple(
        CounterEntry(
            name=c.name, posix=names.posix_name(run_id, f"counter.{c.name}"), count=c.count
        )
        for c in topology.counters
    )
    control = names.posix_name(run_id, "control")
    all_names: list[str] = [bell(sup), control, *(c.posix for c in counters)]
    for entry in instances:
        all_names.append(entry.bell)
        all_names.extend(ep.ring for ep in entry.inboxes)
    return Manifest(
        run_id=run_id,
        supervisor_pid=supervisor_pid,
        supervisor_start_ticks=supervisor_start_ticks,
        supervisor_bell=bell(sup),
        control=control,
        counters=counters,
        instances=instances,
        names=tuple(all_names),
    )


def write_manifest(run_dir: Path, manifest: Manifest) -> None:
    """Write ``names.json`` atomically (a reader never sees half a file)."""
    write_atomic(run_dir / MANIFEST_FILE, orjson.dumps(manifest, option=orjson.OPT_INDENT_2))


def read_manifest(run_dir: str | os.PathLike[str]) -> Manifest:
    """The manifest of a run dir; ValueError naming the file and what is wrong with it."""
    path = Path(run_dir) / MANIFEST_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{path}: no names manifest (is {run_dir} a ringfence run dir?)") from None
    try:
        manifest = _FILES.decode(make_kind(1, 1), data)
    except ProtocolError as e:
        raise ValueError(f"{path}: not a valid names manifest: {e}") from e
    assert isinstance(manifest, Manifest)
    return manifest


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` by writing a sibling and renaming it over."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)

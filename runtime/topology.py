"""Topologies: which actors a run has, how many ranks each, and which channels join them.

The runtime knows actors only by import path (``"package.module:Class"``), so it
never imports an actor package statically; a topology is itself named by import
path in ``runtime.topology``. A channel ``src -> dst`` becomes one single-producer
single-consumer ring per pair of instances: rank to same rank when both actors
have several ranks, and one to each rank when either side has a single instance.
Besides its channels, every instance has a control ring from the supervisor.

An actor is ``attach="required"`` (the default: the run needs every instance ready)
or ``attach="optional"``: its instances are slots that processes outside the run
attach to and leave at will (the users' clients of an engine). The supervisor
never spawns an optional instance, whatever its configured placement, never waits
for one to attach, only warns when an attached one's heartbeat goes stale, and
after one detaches or dies waits for the next attach; it sends an attached one
Stop when the run ends but does not wait for it to go.

An actor of several ranks may be ``restart_together``: its ranks share state that does not
survive the death of any one of them (the Worker's torch.distributed process group), so
the supervisor restarts them as one group. When one rank fails, it SIGKILLs every other
live rank, waits until every old rank process has exited, and spawns every rank again
under one new run epoch and one incarnation number (runtime/supervisor.py). Only ranks the
supervisor spawns can be killed: with ``placement = "external"`` the flag has no effect
(each rank is awaited alone, as any external instance), and an optional actor may not set it.

A topology also names its preflight: checks of the run's config, each an import path of
a function ``check(config) -> None`` that raises ValueError naming the file and the
field at fault (a checkpoint the Worker could not load, a workload the engine could not
read). The supervisor runs them before it creates anything (``run.preflight``), so that a
run its actors would refuse is refused before any process or shared-memory name exists.

Before the preflight come its defaults: import paths of functions ``resolve(config) ->
Resolved`` that fill in settings whose default depends on the machine (the device pool
and the batch limits on a GPU), leaving every key the file or ``--set`` wrote as it is.
The supervisor runs the config they return, writes it to the run dir, logs and prints
their notes (``run.resolve_defaults``).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

from ringfence.runtime.codec import Registry
from ringfence.runtime.imports import TARGET_RE, import_target
from ringfence.runtime.messages import RESERVED_TAG

if TYPE_CHECKING:
    from ringfence.runtime.config import RunConfig

NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
SUPERVISOR = "supervisor"
Attach = Literal["required", "optional"]
ATTACH_MODES: tuple[Attach, ...] = ("required", "optional")


@dataclass(frozen=True, slots=True, kw_only=True)
class ActorSpec:
    name: str  # role name; instances are "<name>-<rank>", logs "<name>-<rank>.jsonl"
    target: str  # import path of the Actor subclass, "package.module:Class"
    ranks: int = 1
    # "optional": slots for processes that come and go (never spawned, never awaited);
    # see the module docstring.
    attach: Attach = "required"
    # True: the ranks fail and restart as one group; see the module docstring.
    restart_together: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class ChannelSpec:
    src: str  # sending actor's name
    dst: str  # receiving actor's name
    protocol: str  # import path of the channel's codec Registry, "package.module:NAME"


@dataclass(frozen=True, slots=True, kw_only=True)
class CounterSpec:
    name: str  # counter block name; actors open it with ctx.counters[name]
    count: int  # counters in the block, each with one writer


class Resolved(NamedTuple):
    """What a topology's defaults function returns: the config with the settings it chose
    filled in, and one line per choice for the terminal and the log (none: nothing chosen)."""

    config: RunConfig
    notes: tuple[str, ...] = ()


class Instance(NamedTuple):
    name: str
    rank: int

    @property
    def id(self) -> str:
        """``"<name>-<rank>"``: how logs, manifests and peers name an instance."""
        return f"{self.name}-{self.rank}"

    @property
    def obj(self) -> str:
        """``"<name>.<rank>"``: the instance as part of a shared-memory object name."""
        return f"{self.name}.{self.rank}"


class Link(NamedTuple):
    src: Instance
    dst: Instance
    protocol: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """Actors, in stop order (the first is stopped first), channels, counter blocks, the
    preflight checks and the defaults functions (import paths, run in order; see the module
    docstring)."""

    actors: tuple[ActorSpec, ...]
    channels: tuple[ChannelSpec, ...] = ()
    counters: tuple[CounterSpec, ...] = ()
    preflight: tuple[str, ...] = ()
    # Functions of the config that fill in the machine's defaults, run in order before the
    # preflight (see the module docstring).
    defaults: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [a.name for a in self.actors]
        for spec in self.actors:
            if not NAME_RE.match(spec.name) or spec.name == SUPERVISOR:
                raise ValueError(f"topology: bad actor name {spec.name!r}")
            if not TARGET_RE.match(spec.target):
                raise ValueError(f"topology: actor {spec.name}: bad target {spec.target!r}")
            if spec.ranks < 1:
                raise ValueError(f"topology: actor {spec.name}: ranks must be >= 1")
            if spec.attach not in ATTACH_MODES:
                raise ValueError(
                    f"topology: actor {spec.name}: attach must be one of {ATTACH_MODES}, "
                    f"got {spec.attach!r}"
                )
            if spec.restart_together and spec.attach == "optional":
                raise ValueError(
                    f"topology: actor {spec.name}: an optional actor cannot restart_together "
                    "(the supervisor never spawns its instances)"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"topology: duplicate actor names in {names}")
        seen = set()
        for ch in self.channels:
            for end in (ch.src, ch.dst):
                if end not in names:
                    raise ValueError(f"topology: channel {ch.src}->{ch.dst}: no actor {end!r}")
            if ch.src == ch.dst or (ch.src, ch.dst) in seen:
                raise ValueError(f"topology: channel {ch.src}->{ch.dst} is a loop or a duplicate")
            seen.add((ch.src, ch.dst))
        for counter in self.counters:
            if not NAME_RE.match(counter.name) or counter.count < 1:
                raise ValueError(f"topology: bad counter block {counter}")
        for check in self.preflight:
            if not TARGET_RE.match(check):
                raise ValueError(f"topology: bad preflight check {check!r}")
        for path in self.defaults:
            if not TARGET_RE.match(path):
                raise ValueError(f"topology: bad defaults function {path!r}")

    def actor(self, name: str) -> ActorSpec:
        for spec in self.actors:
            if spec.name == name:
                return spec
        raise KeyError(f"topology has no actor {name!r}; it has {[a.name for a in self.actors]}")

    def instances(self) -> list[Instance]:
        return [Instance(a.name, r) for a in self.actors for r in range(a.ranks)]

    def links(self) -> Iterator[Link]:
        """Every ring of every channel, as (src instance, dst instance, protocol)."""
        for ch in self.channels:
            src, dst = self.actor(ch.src), self.actor(ch.dst)
            for sr in range(src.ranks):
                for dr in range(dst.ranks):
                    if sr == dr or src.ranks == 1 or dst.ranks == 1:
                        yield Link(Instance(src.name, sr), Instance(dst.name, dr), ch.protocol)

    def check(self) -> None:
        """Import every actor and protocol; check each receiver handles its channels' messages.

        Raises ValueError naming the actor, channel or message at fault. The supervisor
        calls this before it creates anything, so a wiring mistake never half-starts a run.
        """
        from ringfence.runtime.actor import Actor

        classes: dict[str, type[Actor]] = {}
        for spec in self.actors:
            cls = import_target(spec.target)
            if not (isinstance(cls, type) and issubclass(cls, Actor)):
                raise ValueError(f"actor {spec.name}: {spec.target} is not an Actor subclass")
            classes[spec.name] = cls
        for ch in self.channels:
            registry = import_target(ch.protocol)
            if not isinstance(registry, Registry):
                raise ValueError(f"channel {ch.src}->{ch.dst}: {ch.protocol} is not a Registry")
            handled = classes[ch.dst].handlers
            for msg_cls in registry:
                if registry.tag_of(msg_cls) >= RESERVED_TAG:
                    raise ValueError(
                        f"channel {ch.src}->{ch.dst}: {msg_cls.__name__} uses a tag reserved "
                        f"for the runtime (>= {RESERVED_TAG:#x})"
                    )
                if msg_cls not in handled:
                    raise ValueError(
                        f"channel {ch.src}->{ch.dst}: actor {ch.dst} ({classes[ch.dst].__name__})"
                        f" has no handler for {msg_cls.__name__}"
                    )

"""Test-only actors and topologies, launched with ``runtime.topology=fixture_actors:NAME``.

Spawned children import this module by name, so a launch that uses it needs the
tests folder on ``PYTHONPATH`` (``launching.launch_env`` puts it there). Each
topology is the demo pipeline with one actor swapped for a misbehaving subclass;
the channels, protocol and counter block stay the demo's.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace

from ringfence.actors.tools.testing.demo import (
    TOPOLOGY,
    DemoConfig,
    Item,
    LostItem,
    Relay,
    Sink,
    Source,
)
from ringfence.runtime.actor import Actor, handles
from ringfence.runtime.config import RunConfig
from ringfence.runtime.messages import Tick
from ringfence.runtime.topology import ActorSpec, CounterSpec, Resolved, Topology

HANG_AT = 100  # the item whose handler HangingSink blocks in, in its first incarnation
HANG_S = 60.0  # far longer than any heartbeat timeout a test sets


class StartRefused(RuntimeError):
    """Raised by FailingStartRelay.on_start."""


class HangingSink(Sink):
    """The demo sink, except that its first incarnation blocks in the handler of item HANG_AT.

    Blocking inside a handler stops the driver's loop, so the heartbeat goes stale; the
    item is not committed, so the restarted sink is handed it again.
    """

    def on_item(self, msg: Item) -> None:
        if self.ctx.incarnation == 1 and msg.n == HANG_AT:
            threading.Event().wait(HANG_S)
        super().on_item(msg)


class FailingStartRelay(Relay):
    """A relay whose ``on_start`` always raises: the instance never reports ready."""

    def on_start(self) -> None:
        raise StartRefused("fixture relay refuses to start")


class RestartRefusedRelay(Relay):
    """A relay whose second incarnation (its first restart) raises in ``on_start``; the
    first and every later one start as the demo's."""

    def on_start(self) -> None:
        if self.ctx.incarnation == 2:
            raise StartRefused("fixture relay refuses its first restart")
        super().on_start()


@dataclass(frozen=True, slots=True, kw_only=True)
class MisspeltSettings:
    """Settings that declare a section the run's schema lacks (``dmeo``, not ``demo``)."""

    dmeo: DemoConfig


class MisspeltRelay(Relay):
    """A relay whose settings name a section the run lacks: its start fails in attach."""

    config_section = MisspeltSettings


def refuse_run(config: object) -> None:
    """A preflight check that refuses every run, naming a file and a field."""
    raise ValueError("/fixture/settings.json: answer: must be 42, got 41")


def _swap(name: str, target: str) -> Topology:
    """The demo topology with actor ``name`` running class ``target`` instead."""
    actors = tuple(
        replace(spec, target=target) if spec.name == name else spec for spec in TOPOLOGY.actors
    )
    return replace(TOPOLOGY, actors=actors)


HUNG_SINK = _swap("sink", f"{__name__}:HangingSink")
FAILING_START = _swap("relay", f"{__name__}:FailingStartRelay")
FAILING_RESTART = _swap("relay", f"{__name__}:RestartRefusedRelay")
UNKNOWN_SECTION = _swap("relay", f"{__name__}:MisspeltRelay")
# The demo pipeline with a preflight that refuses it: no actor may ever start.
REFUSED = replace(TOPOLOGY, preflight=(f"{__name__}:refuse_run",))

DEFAULT_MESSAGES = 1234  # what fill_messages chooses for demo.messages


def fill_messages(config: RunConfig) -> Resolved:
    """A defaults function: demo.messages is DEFAULT_MESSAGES unless the file or --set gave it."""
    if "demo.messages" in config.explicit:
        return Resolved(config)
    demo = replace(config.section("demo"), messages=DEFAULT_MESSAGES)  # type: ignore[type-var]
    note = f"demo.messages = {DEFAULT_MESSAGES} (the fixture's default)"
    return Resolved(replace(config, tools={**config.tools, "demo": demo}), (note,))


# The demo pipeline whose demo.messages defaults to DEFAULT_MESSAGES at launch.
DEFAULTED = replace(TOPOLOGY, defaults=(f"{__name__}:fill_messages",))


# Fixtures of test_supervisor_edges.py: a slow stop, a run the test ends, a relay of 2 ranks.

STOP_BLOCK_S = 30.0  # far longer than a test waits: only a SIGKILL cuts SlowStopSink's stop
FINISH_FILE = "finish"  # GatedSink asks to end the run once <run dir>/finish exists
RELAYS = 2  # ranks of the relay in RANKED
# Counters of the "ranks" block of RANKED: FORWARDED_BY[r] is written by relay-r, and
# APPLIED_FROM[r] (items of relay-r applied so far) by the sink.
FORWARDED_BY = (0, 1)
APPLIED_FROM = (2, 3)


class SlowStopSink(Sink):
    """The demo sink, except that its ``on_stop`` blocks for STOP_BLOCK_S."""

    def on_stop(self) -> None:
        threading.Event().wait(STOP_BLOCK_S)


class GatedSink(Sink):
    """The demo sink, except that it asks once to end the run when <run dir>/FINISH_FILE exists.

    With ``demo.messages = 0`` the test ends a streaming run with status 0 when it chooses.
    """

    tick_s = 0.05

    def on_start(self) -> None:
        super().on_start()
        self.finishing = False

    @handles(Tick)
    def on_tick(self, msg: Tick) -> None:
        run_dir = self.ctx.run_dir
        if not self.finishing and run_dir is not None and (run_dir / FINISH_FILE).exists():
            self.finishing = True
            self.request_shutdown("finish file found")


BREAK_FILE = "break"  # BreakingSink's first incarnation fails once <run dir>/break exists


class SinkBroke(RuntimeError):
    """Raised by BreakingSink's tick, and re-raised by its on_failure: the instance ends."""


class BreakingSink(GatedSink):
    """The gated sink, except that its first incarnation fails (its loop raises, the instance
    ends) at the first tick after <run dir>/BREAK_FILE exists; later ones run as the demo's."""

    @handles(Tick)
    def on_tick(self, msg: Tick) -> None:
        run_dir = self.ctx.run_dir
        if self.ctx.incarnation == 1 and run_dir is not None and (run_dir / BREAK_FILE).exists():
            raise SinkBroke("fixture sink breaks as asked")
        super().on_tick(msg)

    def on_failure(self, error: Exception, delivery: object) -> None:
        if isinstance(error, SinkBroke):
            raise error


class RoundRobinSource(Source):
    """The demo source, except that item n goes to instance relay-((n - 1) % RELAYS)."""

    def send(self, to: str, msg: object, *, timeout: float | None = None) -> int:
        assert isinstance(msg, Item)
        return super().send(f"{to}-{(msg.n - 1) % RELAYS}", msg, timeout=timeout)


class RankedRelay(Actor):
    """Forwards each item once to the sink; each rank records the progress of its own items."""

    def on_start(self) -> None:
        self.forwarded = self.ctx.counters["ranks"][FORWARDED_BY[self.ctx.rank]]
        self.forwarded.claim()

    @handles(Item)
    def on_item(self, msg: Item) -> None:
        if msg.n <= self.forwarded.value():
            return  # a repeat
        self.send("sink", msg)
        self.forwarded.advance(msg.n)


class MergingSink(Actor):
    """Applies the items of each relay rank in their order, exactly once; ends the run after all.

    Relay r carries items r + 1, r + 1 + RELAYS, ...; the ranks' streams interleave in any
    order, so the sink keeps a count per rank: the next item from relay r is
    r + 1 + RELAYS * count_r. An earlier one is a repeat; a later one, or an item from the
    wrong rank, is a lost item.
    """

    config_section = "demo"

    def on_start(self) -> None:
        assert isinstance(self.ctx.config, DemoConfig)
        self.total = self.ctx.config.messages
        block = self.ctx.counters["ranks"]
        self.applied = [block[i] for i in APPLIED_FROM]
        for counter in self.applied:
            counter.claim()

    @handles(Item)
    def on_item(self, msg: Item) -> None:
        rank = (msg.n - 1) % RELAYS
        delivery = self.ctx.services.current
        assert delivery is not None
        if delivery.peer != f"relay-{rank}":
            raise LostItem(f"item {msg.n} came from {delivery.peer}, not relay-{rank}")
        applied = self.applied[rank]
        expected = rank + 1 + RELAYS * applied.value()
        if msg.n < expected:
            return  # a repeat
        if msg.n != expected:
            raise LostItem(f"item {msg.n} from relay-{rank} arrived before {expected}")
        applied.advance(applied.value() + 1)
        if sum(counter.value() for counter in self.applied) == self.total:
            self.request_shutdown(f"ranks: {self.total} items delivered")

    def on_failure(self, error: Exception, delivery: object) -> None:
        if isinstance(error, LostItem):
            raise error


SLOW_STOP_SINK = _swap("sink", f"{__name__}:SlowStopSink")
BREAKING_SINK = _swap("sink", f"{__name__}:BreakingSink")
GATED_SINK = _swap("sink", f"{__name__}:GatedSink")
# source (1 rank) -> relay (RELAYS ranks) -> sink (1 rank), on the demo's channels.
RANKED = Topology(
    actors=(
        ActorSpec(name="source", target=f"{__name__}:RoundRobinSource"),
        ActorSpec(name="relay", target=f"{__name__}:RankedRelay", ranks=RELAYS),
        ActorSpec(name="sink", target=f"{__name__}:MergingSink"),
    ),
    channels=TOPOLOGY.channels,
    counters=(
        *TOPOLOGY.counters,
        CounterSpec(name="ranks", count=len(FORWARDED_BY + APPLIED_FROM)),
    ),
)


# Fixtures of test_supervisor_groups.py: ranks that restart together, beside ranks that do not.


class Idle(Actor):
    """Handles nothing and only beats: a rank whose spawns, exits and restarts a test follows."""


def _grouped(ranks: int) -> Topology:
    """A "worker" of ``ranks`` ranks that restart together, and a "lane" of 2 that do not."""
    return Topology(
        actors=(
            ActorSpec(name="worker", target=f"{__name__}:Idle", ranks=ranks, restart_together=True),
            ActorSpec(name="lane", target=f"{__name__}:Idle", ranks=2),
        )
    )


GROUP_OF_2 = _grouped(2)
GROUP_OF_3 = _grouped(3)

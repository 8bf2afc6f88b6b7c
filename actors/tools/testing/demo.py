"""The demo pipeline: source -> relay -> sink, numbered items, exactly-once effect across restarts.

The runtime's own workload, used by the runtime's tests, by the hop benchmark and by
scripts/embed_example. It knows nothing of KV caches.

Every item carries its number ``n`` (1, 2, ...) and a checksum of its data. Each
actor keeps its progress in the ``demo`` counter block (one writer per counter),
and the handlers are idempotent by ``n``: delivery is at least once (the item whose
handler a crash cut short is handed over again), and the number turns that into an
exactly-once effect. The sink applies ``n`` only if it is the next one, counts and
drops repeats, and treats a gap (a lost item) or a bad checksum as a broken
invariant. With ``demo.messages > 0`` the sink asks for the run to end once it has
applied them all.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from dataclasses import dataclass

from ringfence.runtime.actor import Actor, handles
from ringfence.runtime.codec import Registry, message
from ringfence.runtime.config import setting
from ringfence.runtime.topology import ActorSpec, ChannelSpec, CounterSpec, Topology
from ringfence.shm.errors import RingfenceError

DEMO = Registry("demo")

# Counters of the "demo" block, each written by one actor.
SENT, FORWARDED, APPLIED, SINK_REPEATS, RELAY_REPEATS = range(5)
BATCH = 256  # items a source sends per turn of its loop


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    """[demo]: the demo pipeline run before the engine exists."""

    messages: int = setting(100000, "messages to send; 0 = stream until stopped", ge=0)
    payload_bytes: int = setting(64, "payload bytes per message", ge=0, le=65536)


class LostItem(RingfenceError, AssertionError):
    """The sink saw a gap in the item numbers, or an item whose data does not match."""


@message(DEMO, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class Item:
    n: int  # 1, 2, ...: the item's number, the key of every idempotence check
    data: str  # payload of demo.payload_bytes characters
    crc: int  # zlib.crc32 of data


@dataclass(frozen=True, slots=True, kw_only=True)
class Produce:
    """The source's timer message: send the next batch (never on a ring)."""


def make_item(n: int, size: int) -> Item:
    stem = f"{n:016x}"
    data = (stem * (size // 16 + 1))[:size]
    return Item(n=n, data=data, crc=zlib.crc32(data.encode()))


class Source(Actor):
    """Sends items 1..demo.messages (forever if 0), resuming after the last one it recorded."""

    config_section = "demo"
    downstream = "relay"

    def on_start(self) -> None:
        assert isinstance(self.ctx.config, DemoConfig)
        self.config = self.ctx.config
        self.sent = self.ctx.counters["demo"][SENT]
        self.sent.claim()
        self.schedule(0.0, Produce())

    @handles(Produce)
    def produce(self, msg: Produce) -> None:
        total, size = self.config.messages, self.config.payload_bytes
        n = self.sent.value()
        last = n + BATCH if total == 0 else min(n + BATCH, total)
        while n < last:
            n += 1
            self.send(self.downstream, make_item(n, size))
            self.sent.advance(n)  # after the send: a crash in between resends n, never skips it
        if total == 0 or n < total:
            self.schedule(0.0, Produce())
        else:
            self.log.info("demo.sent", messages=n)


class Relay(Actor):
    """Forwards each item once to the sink, dropping repeats of items it already forwarded."""

    def on_start(self) -> None:
        block = self.ctx.counters["demo"]
        self.forwarded, self.repeats = block[FORWARDED], block[RELAY_REPEATS]
        self.forwarded.claim()
        self.repeats.claim()

    @handles(Item)
    def on_item(self, msg: Item) -> None:
        if msg.n <= self.forwarded.value():
            self.repeats.advance(self.repeats.value() + 1)
            return
        self.send("sink", msg)
        self.forwarded.advance(msg.n)


class Sink(Actor):
    """Applies items strictly in order, exactly once; ends the run after demo.messages."""

    config_section = "demo"

    def on_start(self) -> None:
        assert isinstance(self.ctx.config, DemoConfig)
        self.total = self.ctx.config.messages
        block = self.ctx.counters["demo"]
        self.applied, self.repeats = block[APPLIED], block[SINK_REPEATS]
        self.applied.claim()
        self.repeats.claim()
        self.first_at: float | None = None
        self.first_n = self.applied.value() + 1

    @handles(Item)
    def on_item(self, msg: Item) -> None:
        applied = self.applied.value()
        if msg.n <= applied:
            self.repeats.advance(self.repeats.value() + 1)
            return
        if msg.n != applied + 1:
            raise LostItem(f"item {msg.n} arrived after {applied}: items were lost")
        if zlib.crc32(msg.data.encode()) != msg.crc:
            raise LostItem(f"item {msg.n}: data does not match its checksum")
        if self.first_at is None:
            self.first_at = time.monotonic()
        self.applied.advance(msg.n)
        if msg.n == self.total:
            elapsed = time.monotonic() - self.first_at
            count = msg.n - self.first_n + 1
            self.log.info(
                "demo.done",
                messages=msg.n,
                received=count,
                elapsed_s=round(elapsed, 6),
                per_s=round(count / elapsed) if elapsed > 0 else None,
                repeats=self.repeats.value(),
            )
            self.request_shutdown(f"demo: {msg.n} items delivered")

    def on_failure(self, error: Exception, delivery: object) -> None:
        if isinstance(error, LostItem):
            raise error  # a broken invariant ends the instance; never log and carry on


class HopSource(Source):
    downstream = "sink"


_PROTOCOL = f"{__name__}:DEMO"
_COUNTERS = (CounterSpec(name="demo", count=8),)

# Stop order: the source first, so nothing is sent to an actor that already stopped.
TOPOLOGY = Topology(
    actors=(
        ActorSpec(name="source", target=f"{__name__}:Source"),
        ActorSpec(name="relay", target=f"{__name__}:Relay"),
        ActorSpec(name="sink", target=f"{__name__}:Sink"),
    ),
    channels=(
        ChannelSpec(src="source", dst="relay", protocol=_PROTOCOL),
        ChannelSpec(src="relay", dst="sink", protocol=_PROTOCOL),
    ),
    counters=_COUNTERS,
)

# One hop: what the hop benchmark measures against a bare ring.
HOP = Topology(
    actors=(
        ActorSpec(name="source", target=f"{__name__}:HopSource"),
        ActorSpec(name="sink", target=f"{__name__}:Sink"),
    ),
    channels=(ChannelSpec(src="source", dst="sink", protocol=_PROTOCOL),),
    counters=_COUNTERS,
)

"""One actor fed through real shared-memory rings and driven from the test's thread.

:func:`ring_rig` runs ``actor_cls`` as instance ``<name>-0`` of run ``run_id`` with two
ring inboxes that only the test writes: the supervisor's control ring (``supervisor-0``,
runtime messages) and a ring from ``peer`` decoded with the ``inbox`` registry. What the
actor sends to ``peer`` lands in an in-process inbox the test reads. The rings are real,
so the test may put any frame on them, bytes no codec would write included, and the
actor's driver reads them as it reads any ring. Its answers to ``peer`` go through a
real ring too (with a launch's frame size limit), which the test reads and decodes with
the ``replies`` registry. :meth:`RingRig.turn` runs the driver
(``Driver.poll``) in the test's own thread until nothing is left to handle, so every
frame put before it has been handled, in order, when it returns. The run's ``lanes``
and control counter blocks exist as in a launched run (counter 0 of the control block
is the run epoch); the test writes the other lanes' watermarks itself.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ringfence.actors.protocol.lanes import LANE_SLOTS, LANES
from ringfence.runtime.actor import Actor, config_of
from ringfence.runtime.codec import Registry
from ringfence.runtime.config import RunConfig
from ringfence.runtime.control import InstanceControl, control_count
from ringfence.runtime.driver import Driver
from ringfence.runtime.log import ActorLog
from ringfence.runtime.mailbox import Delivery, Mailbox, RingInbox, RingOutbox
from ringfence.runtime.messages import RUNTIME
from ringfence.shm import names
from ringfence.shm.counter import CounterBlock
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.ring import Ring
from ringfence.shm.ring_reader import RingReader
from ringfence.shm.ring_writer import RingWriter

SUPERVISOR = "supervisor-0"
RING_BYTES = 1 << 20  # a run's default ring size: the same frame size limit as a launch
PUT_TIMEOUT_S = 5.0
FRAME_OVERHEAD = 16 + 8  # a frame header, and padding to 8 bytes
# A frame must fit before the end of the data area, or after a wrap: with half the ring
# free beyond the frame itself, it always does.


@dataclass
class RingRig:
    """A driver on rings, the test's writers into them, and what the actor sent back."""

    driver: Driver
    feed: RingWriter  # peer -> actor
    control: RingWriter  # supervisor -> actor
    replies: RingInbox  # actor -> peer, read by the test
    lanes: CounterBlock
    counters: CounterBlock  # the run's control block: counter 0 is the epoch
    log_path: Path
    registry: Registry  # what the inbox from the peer is decoded with

    @property
    def actor(self) -> Any:
        return self.driver.actor

    @property
    def max_payload(self) -> int:
        return self.feed.ring.max_payload

    def put(self, kind: int, payload: bytes) -> int:
        """Put one frame on the ring from the peer; its transport seq. The actor handles
        what is there first if the frame might not fit (nobody else would make room)."""
        if self.feed.free_bytes() < RING_BYTES // 2 + len(payload) + FRAME_OVERHEAD:
            self.turn()
        return self.feed.put(kind, payload, PUT_TIMEOUT_S)

    def post(self, msg: object) -> int:
        """Encode ``msg`` with the inbox's registry and put it on the ring; its seq."""
        return self.put(*self.registry.encode(msg))

    def turn(self) -> int:
        """Handle everything the actor has been sent, in this thread; how many messages."""
        total = 0
        while handled := self.driver.poll(0):
            total += handled
        return total

    def take_replies(self) -> list[Delivery]:
        """What the actor sent the peer since the last call."""
        taken = list(iter(self.replies.read, None))
        self.replies.commit()
        return taken

    def events(self, name: str) -> list[dict[str, Any]]:
        self.driver.log.flush()
        lines = [orjson.loads(line) for line in self.log_path.read_bytes().splitlines()]
        return [line for line in lines if line["event"] == name]


@contextmanager
def ring_rig(
    actor_cls: type[Actor],
    name: str,
    *,
    config: RunConfig,
    run_id: str,
    log_dir: Path,
    inbox: Registry,
    replies: Registry,
    peer: str = "engine-0",
    epoch: int = 0,
) -> Iterator[RingRig]:
    """Start ``actor_cls`` as ``<name>-0`` (see the module docstring); close and unlink
    everything on the way out."""
    with ExitStack() as stack:

        def made(obj: Any) -> Any:
            stack.callback(obj.unlink)
            stack.callback(obj.close)
            return obj

        lanes = made(CounterBlock.create(names.posix_name(run_id, LANES), LANE_SLOTS))
        counters = made(CounterBlock.create(names.posix_name(run_id, "control"), control_count(1)))
        counters[0].claim()
        counters[0].advance(epoch)
        bell = made(Doorbell.create(names.posix_name(run_id, f"bell.{name}"), spin_us=0))
        ours = made(Doorbell.create(names.posix_name(run_id, "bell.test"), spin_us=0))

        def ring(
            source: str, consumer: Doorbell, producer: Doorbell
        ) -> tuple[RingWriter, RingReader]:
            made_ring = made(Ring.create(names.posix_name(run_id, f"ring.{source}"), RING_BYTES))
            writer = RingWriter(made_ring, wake=consumer, space=producer)
            reader = RingReader(made_ring, bell=consumer, space=producer)
            stack.callback(writer.close)
            stack.callback(reader.close)
            return writer, reader

        control, from_supervisor = ring("supervisor", bell, ours)
        feed, from_peer = ring("peer", bell, ours)
        to_peer, answers = ring("answers", ours, bell)
        mailbox = Mailbox(
            bell,
            [RingInbox(SUPERVISOR, from_supervisor, RUNTIME), RingInbox(peer, from_peer, inbox)],
            [RingOutbox(peer, to_peer, replies)],
        )
        log_path = log_dir / f"{name}-0.jsonl"
        driver = Driver(
            actor_cls,
            name=name,
            rank=0,
            mailbox=mailbox,
            runtime=config.runtime,
            log=ActorLog(log_path, actor=name, rank=0, epoch=epoch),
            config=config_of(actor_cls, config),  # its own sections, as a launch gives
            run_id=run_id,
            counters={LANES: lanes},
            control=InstanceControl.of(counters, 0),
        )
        stack.callback(driver.close)  # before the rings and bells it reads go
        driver.start()
        replies_inbox = RingInbox(f"{name}-0", answers, replies)
        yield RingRig(driver, feed, control, replies_inbox, lanes, counters, log_path, inbox)

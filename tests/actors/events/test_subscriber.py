"""Following an instance's KV events (actors/events/subscriber.py) against the real
publisher: the kept history first, then the live stream, each batch once and in order; a
gap filled from the replay socket; numbers that go back taken as a restarted engine."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import zmq

from ringfence.actors.events.publisher import EventPublisher
from ringfence.actors.events.subscriber import EventFollower
from ringfence.actors.events.wire import encode_batch
from ringfence.cache.ids import BlockHash
from ringfence.cache.kv_events import BlockStored, KVEvent

WAIT_S = 10.0


def batch(n: int, ts: float = 0.0) -> bytes:
    """A batch storing one block whose key says ``n``, published at ``ts`` + n."""
    event = BlockStored(keys=(BlockHash(n.to_bytes(16, "big")),), parent=None, token_ids=(),
                        block_size=4, medium="GPU")  # fmt: skip
    return encode_batch(ts + n, [event], layout="map")


def number(events: list[KVEvent]) -> int:
    (event,) = events
    assert isinstance(event, BlockStored)
    return int.from_bytes(event.keys[0], "big")


class Heard:
    """What a follower handed on, with a wait for the n-th batch."""

    def __init__(self) -> None:
        self.numbers: list[int] = []
        self.resets = 0
        self._cond = threading.Condition()

    def on_batch(self, events: list[KVEvent]) -> None:
        with self._cond:
            self.numbers.append(number(events))
            self._cond.notify_all()

    def on_reset(self) -> None:
        self.resets += 1

    def wait_for(self, count: int) -> list[int]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.numbers) >= count, WAIT_S), self.numbers
            return list(self.numbers)


@pytest.fixture
def publisher() -> Iterator[EventPublisher]:
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=100)
    yield pub
    pub.close()


def follower(publisher: EventPublisher, heard: Heard) -> EventFollower:
    ends = publisher.endpoints
    return EventFollower(ends.publish, ends.replay, on_batch=heard.on_batch,
                         on_reset=heard.on_reset)  # fmt: skip


def test_the_kept_history_comes_first_then_the_live_stream_each_once_in_order(publisher):
    for n in range(5):
        publisher.publish(batch(n))
    heard = Heard()
    follow = follower(publisher, heard).start()
    try:
        assert heard.wait_for(5) == [0, 1, 2, 3, 4]
        for n in range(5, 40):
            publisher.publish(batch(n))
        # Batches the SUB socket missed while it joined come from the replay (a gap).
        assert heard.wait_for(40) == list(range(40))
    finally:
        follow.close()
    assert follow.counts.batches == 40 and follow.counts.lost == 0


def test_a_gap_is_filled_from_the_replay_and_numbers_going_back_are_a_restart(publisher):
    for n in range(10):
        publisher.publish(batch(n))
    heard = Heard()
    follow = follower(publisher, heard)  # driven by hand here: its thread is not started
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    replay = ctx.socket(zmq.DEALER)
    replay.connect(publisher.endpoints.replay)
    try:
        follow.last = 3
        follow._receive(7, batch(7), replay)  # 4, 5, 6 missed: replayed, then 7 on
        assert heard.numbers == [4, 5, 6, 7, 8, 9] and follow.counts.gaps == 1
        follow._receive(8, batch(8), replay)  # a repeat
        assert heard.numbers == [4, 5, 6, 7, 8, 9]
        follow._receive(0, batch(0), replay)  # batch 0 again, of the same time: a repeat
        assert heard.resets == 0
        follow._first_ts = 0.0  # as if batch 0 had been handed on (it was not, here)
        follow._receive(0, batch(0, ts=100.0), replay)  # a batch 0 of another time
        assert heard.resets == 1 and follow.counts.restarts == 1
        # The new engine's stream is replayed from 0 (this publisher kept the old one).
        assert heard.numbers[6:] == list(range(10))
    finally:
        replay.close(linger=0)
        ctx.term()
        follow.close()

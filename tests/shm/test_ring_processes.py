"""The ring between processes: a million-frame stress, backpressure, crashes and dead peers."""

from __future__ import annotations

import os
import signal
import threading
import zlib

import peers
import pytest
from peers import finish, start

from ringfence.actors.tools.testing.shm import reap, ring_pair
from ringfence.shm import names
from ringfence.shm.counter import CounterBlock
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.errors import ActorDead, RingFull
from ringfence.shm.segment import Segment


def stress(frames: int, capacity: int, max_size: int, seed: int, batched: bool = False):
    """Frames of the seed's plan through a ring between processes; ``batched``: published
    with put_many and read with take (else put, and drain or get)."""
    with ring_pair(capacity=capacity) as p:
        p.writer.close()
        producer = start(
            peers.stress_producer,
            p.ring.name,
            p.consumer_bell.name,
            p.producer_bell.name,
            seed,
            frames,
            max_size,
            batched,
        )
        try:
            expected = peers.payload_plan(seed, frames, max_size)
            received = 0
            while received < frames:
                if batched:
                    batch = p.reader.take(256) if p.reader.wait_pending(30) else None
                    assert batch is not None, "no frame within 30 s"
                    p.reader.commit(batch)
                    got = batch.frames()
                else:
                    got = p.reader.drain(256) or [p.reader.get(timeout=30)]
                for frame in got:
                    kind, payload = next(expected)
                    received += 1
                    assert frame.seq == received, "frames out of order"
                    assert frame.kind == kind
                    assert zlib.crc32(frame.payload[4:]) == int.from_bytes(
                        frame.payload[:4], "little"
                    )
                    assert frame.payload == payload
            assert finish(producer) == 0
            assert p.ring.used_bytes() == 0
        finally:
            reap(producer)


def test_100_000_frames_of_random_sizes_pass_a_small_ring_intact_and_in_order(rng):
    # 16 KiB ring, frames of 4..1028 bytes: about 3,000 wraparounds (the soak: 10 million).
    stress(frames=100_000, capacity=16384, max_size=1024, seed=rng.randrange(1 << 32))


def test_100_000_frames_in_batches_pass_a_small_ring_intact_and_in_order(rng):
    # put_many batches of 1..16 frames (wrap markers inside batches), read with take.
    seed = rng.randrange(1 << 32)
    stress(frames=100_000, capacity=16384, max_size=1024, seed=seed, batched=True)


@pytest.mark.slow
def test_ten_million_frames_soak(rng):
    stress(frames=10_000_000, capacity=8192, max_size=2000, seed=rng.randrange(1 << 32))


def test_a_slow_consumer_makes_the_producer_wait_and_nothing_is_lost_or_reordered():
    count = 400
    with ring_pair(capacity=512) as p:
        p.reader.close()
        consumer = start(
            peers.slow_consumer,
            p.ring.name,
            p.consumer_bell.name,
            p.producer_bell.name,
            count,
            0.002,  # per frame: a producer descheduled on a busy machine still outpaces it
        )
        try:
            for i in range(count):
                p.writer.put(1, i.to_bytes(4, "little") * 8, timeout=30)
            assert finish(consumer) == 0
        finally:
            reap(consumer)
        assert p.writer.full_waits > count // 2, (
            "the producer should have waited for room most of the time"
        )


class Producer(threading.Thread):
    """Puts ``count`` numbered frames then STOP, riding out consumer deaths and restarts."""

    def __init__(self, writer, count):
        super().__init__(daemon=True)
        self.writer, self.count, self.error = writer, count, None

    def run(self):
        try:
            for i in range(self.count + 1):
                kind, payload = (
                    (peers.STOP, b"") if i == self.count else (1, i.to_bytes(8, "little"))
                )
                while True:
                    try:
                        self.writer.put(kind, payload, timeout=1)
                        break
                    except (RingFull, ActorDead):
                        continue  # the consumer is being restarted
        except BaseException as e:
            self.error = e


def test_a_consumer_killed_mid_stream_is_resumed_exactly_at_the_committed_tail(rng, run_id):
    count, kills = 20_000, 6
    with ring_pair(capacity=1024, run_id=run_id) as p:
        counts = Segment.create(names.posix_name(run_id, "counts"), 8 * (count + 2))
        marks = CounterBlock.create(names.posix_name(run_id, "marks"), 2)
        watch = Doorbell.create(names.posix_name(run_id, "watch"))
        p.reader.close()
        producer = Producer(p.writer, count)
        procs = []
        try:
            producer.start()
            args = (
                p.ring.name,
                p.consumer_bell.name,
                p.producer_bell.name,
                counts.name,
                marks.segment.name,
                watch.name,
            )
            redone = set()
            for _ in range(kills):
                tail_seq = p.ring.words[17]
                target = tail_seq + rng.randrange(1, count // (kills + 1))
                procs.append(start(peers.durable_consumer, *args))
                marks[0].wait_for(target, timeout=60, bell=watch)
                os.kill(procs[-1].pid, signal.SIGKILL)
                procs[-1].join(10)
                first = marks[1].value()
                assert first in (tail_seq + 1, tail_seq) or (tail_seq == 0 and first == 1), (
                    f"resumed at {first}, committed tail was {tail_seq}"
                )
                if first == tail_seq:
                    redone.add(first)
                redone.add(p.ring.words[17] + 1)  # the frame in flight when the kill landed
            procs.append(start(peers.durable_consumer, *args))
            assert finish(procs[-1]) == 0
            producer.join(30)
            assert producer.error is None
            work = counts.u64(0, count + 2)
            for seq in range(1, count + 1):
                assert work[seq] == 1 or (work[seq] == 2 and seq in redone), (
                    f"frame {seq} done {work[seq]} times"
                )
            assert p.ring.used_bytes() == 0
        finally:
            for proc in procs:
                reap(proc)
            for obj in (counts, marks, watch):
                obj.close()
                obj.unlink()


def peer_that_exits(p, role: str) -> None:
    """Hand ``role``'s end of the pair's ring to a child that opens it and exits."""
    (p.writer if role == "producer" else p.reader).close()
    names_ = (p.ring.name, p.consumer_bell.name, p.producer_bell.name)
    assert finish(start(peers.attach_and_exit, *names_, role)) == 0


def test_a_consumer_waiting_on_a_dead_producer_gets_actor_dead_not_a_hang():
    with ring_pair() as p:
        peer_that_exits(p, "producer")
        assert p.reader.get(timeout=1).payload == b"last words"
        with pytest.raises(ActorDead, match="producer pid"):
            p.reader.get(timeout=0.05)


def test_a_producer_facing_a_full_ring_and_a_dead_consumer_gets_actor_dead():
    with ring_pair(capacity=256) as p:
        peer_that_exits(p, "consumer")
        with pytest.raises(ActorDead, match="consumer pid"):
            for _ in range(100):
                p.writer.put(1, bytes(64), timeout=0.05)

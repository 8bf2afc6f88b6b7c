"""Child-process bodies for the cross-process tests (spawned with multiprocess, so module-level)."""

from __future__ import annotations

import random
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import multiprocess

from ringfence.actors.tools.testing.shm import reap
from ringfence.shm.counter import CounterBlock
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.ring import Ring
from ringfence.shm.ring_reader import RingReader
from ringfence.shm.ring_writer import RingWriter
from ringfence.shm.segment import Segment

STOP = 0xFFFF
POOL_BYTES = 1 << 16
# Children are spawned, never forked: no inherited threads, locks or CUDA context.
SPAWN = multiprocess.get_context("spawn")


def start(target: Callable[..., None], *args: Any) -> Any:
    """Start ``target(*args)`` (module-level, so picklable) in a spawned daemon child."""
    proc = SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def finish(proc: Any, timeout: float = 60) -> int:
    """The child's exit code once it ended; past ``timeout`` it is killed and the test fails."""
    proc.join(timeout)
    if proc.is_alive():
        reap(proc)
        raise AssertionError(f"child {proc.pid} did not finish within {timeout}s")
    return int(proc.exitcode)


@contextmanager
def ring_ends(ring_name: str, *bell_names: str) -> Iterator[tuple[Any, ...]]:
    """Attach a ring and doorbells by name; close them all on the way out."""
    opened: tuple[Ring | Doorbell, ...] = (
        Ring.attach(ring_name),
        *(Doorbell.attach(n) for n in bell_names),
    )
    try:
        yield opened
    finally:
        for obj in opened:
            obj.close()


def payload_plan(seed: int, count: int, max_size: int):
    """The (kind, payload) of every frame of a stress stream; both sides derive it from the seed."""
    rng = random.Random(seed)
    pool = rng.randbytes(POOL_BYTES + max_size)
    for _ in range(count):
        size = rng.randrange(max_size + 1)
        off = rng.randrange(POOL_BYTES)
        body = pool[off : off + size]
        yield size & 0xFFFF, zlib.crc32(body).to_bytes(4, "little") + body


def stress_producer(
    ring_name: str,
    wake_name: str,
    space_name: str,
    seed: int,
    count: int,
    max_size: int,
    batched: bool = False,
):
    """Publish the plan one frame a put, or (``batched``) in put_many batches of 1..16
    frames, each cut short where it would pass the ring's batch limit."""
    with ring_ends(ring_name, wake_name, space_name) as (ring, wake, space):
        writer = RingWriter(ring, wake=wake, space=space)
        if not batched:
            for kind, payload in payload_plan(seed, count, max_size):
                writer.put(kind, payload, timeout=30)
            return
        sizes = random.Random(seed + 1)
        batch: list[tuple[int, bytes]] = []
        want, framed = sizes.randint(1, 16), 0
        for kind, payload in payload_plan(seed, count, max_size):
            size = 16 + (len(payload) + 7) // 8 * 8
            if batch and (len(batch) == want or framed + size > writer.max_batch):
                writer.put_many(batch, timeout=30)
                batch, want, framed = [], sizes.randint(1, 16), 0
            batch.append((kind, payload))
            framed += size
        writer.put_many(batch, timeout=30)


def durable_consumer(
    ring_name: str,
    bell_name: str,
    space_name: str,
    counts_name: str,
    marks_name: str,
    watch_name: str,
):
    """Consume until STOP: count each frame's work in shared memory, then commit, then report.

    marks[0] is the last committed seq (rings ``watch``); marks[1] the first seq this
    incarnation received.
    """
    with ring_ends(ring_name, bell_name, space_name) as (ring, bell, space):
        counts_seg = Segment.attach(counts_name)
        marks, watch = CounterBlock.attach(marks_name), Doorbell.attach(watch_name)
        try:
            counts = counts_seg.u64(0, counts_seg.size // 8)
            progress, first = marks[0], marks[1]
            progress.claim(notify=[watch])
            first.claim()
            reader = RingReader(ring, bell=bell, space=space)
            seen_first = False
            while True:
                frame = reader.recv(timeout=30)
                if not seen_first:
                    first.advance(frame.seq)
                    seen_first = True
                if frame.kind == STOP:
                    reader.commit(frame)
                    return
                counts[frame.seq] += 1  # the work: done before the commit, so a crash redoes it
                reader.commit(frame)
                progress.advance(frame.seq)
        finally:
            for obj in (counts_seg, marks, watch):
                obj.close()


def slow_consumer(ring_name: str, bell_name: str, space_name: str, count: int, work_s: float):
    """Take ``count`` frames, each after ``work_s`` of simulated work; exit 1 on any disorder."""
    with ring_ends(ring_name, bell_name, space_name) as (ring, bell, space):
        reader = RingReader(ring, bell=bell, space=space)
        for i in range(count):
            frame = reader.get(timeout=30)
            if frame.payload != i.to_bytes(4, "little") * 8:
                sys.exit(1)
            time.sleep(work_s)  # simulated per-frame work, not a wait for anything


def attach_and_exit(ring_name: str, bell_name: str, space_name: str, role: str):
    """Open one end of a ring, publish one frame if producer, then exit (a peer that dies)."""
    with ring_ends(ring_name, bell_name, space_name) as (ring, bell, space):
        if role == "producer":
            RingWriter(ring, wake=bell, space=space).put(1, b"last words", timeout=5)
        else:
            RingReader(ring, bell=bell, space=space)


def counter_writer(marks_name: str, watch_name: str, count: int):
    """Advance counter 0 through values whose two 32-bit halves are equal (a torn read shows)."""
    marks, watch = CounterBlock.attach(marks_name), Doorbell.attach(watch_name)
    try:
        mark = marks[0]
        mark.claim(notify=[watch])
        for k in range(1, count + 1):
            mark.advance(k << 32 | k)
    finally:
        marks.close()
        watch.close()


def counter_echo(marks_name: str, own_bell: str, peer_bell: str, count: int, spin_us: float):
    """Ping-pong: wait for counter 0 to reach k, then advance counter 1 to k, for k = 1..count."""
    marks = CounterBlock.attach(marks_name)
    bell, peer = Doorbell.attach(own_bell, spin_us=spin_us), Doorbell.attach(peer_bell)
    try:
        ping, pong = marks[0], marks[1]
        pong.claim(notify=[peer])
        for k in range(1, count + 1):
            ping.wait_for(k, timeout=10, bell=bell)
            pong.advance(k)
    finally:
        for obj in (marks, bell, peer):
            obj.close()


def lease_and_exit(run_id: str):
    """Create a run's lease and one segment, then die without cleaning (a killed supervisor)."""
    from ringfence.shm import names

    names.write_lease(run_id)
    Segment.create(names.posix_name(run_id, "orphan"), 64).close()


def count_wakeups(bell_name: str, marks_name: str, watch_name: str):
    """Sleep on ``bell`` until counter 0 reaches 1; store how often the condition was checked.

    Counter 2 goes to 1 when the sleeper is about to block (rings ``watch``); counter 1
    holds the number of checks at the end.
    """
    bell, marks, watch = (
        Doorbell.attach(bell_name, spin_us=0),
        CounterBlock.attach(marks_name),
        Doorbell.attach(watch_name),
    )
    try:
        armed = marks[2]
        armed.claim(notify=[watch])
        checks = []

        def reply_arrived():
            checks.append(1)
            if len(checks) == 2:
                armed.advance(1)
            return marks[0].value() >= 1

        assert bell.wait_until(reply_arrived, 10)
        marks[1].advance(len(checks))
    finally:
        for obj in (bell, marks, watch):
            obj.close()

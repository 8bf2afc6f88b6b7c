"""The SPSC ring within one process: framing, limits, deadlines, durable consumption, bad frames."""

from __future__ import annotations

import queue
import struct
import threading
import time
from collections import deque

import multiprocess
import peers
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringfence.actors.tools.testing.shm import reap, ring_pair
from ringfence.shm import names
from ringfence.shm.counter import CounterBlock
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.errors import (
    EndpointTaken,
    ProtocolError,
    RingEmpty,
    RingFull,
    SegmentLayoutError,
)
from ringfence.shm.ring import FRAME, HEADER_BYTES, Ring
from ringfence.shm.ring_reader import RingReader
from ringfence.shm.ring_writer import RingWriter
from ringfence.shm.segment import Segment

SPAWN = multiprocess.get_context("spawn")


def frame_bytes(n: int) -> int:
    return FRAME.size + (n + 7) // 8 * 8


def needed_bytes(p, n: int) -> int:
    """Room a put of ``n`` bytes needs now: its frame, plus the tail skipped if it wraps."""
    rem = p.ring.capacity - p.ring.words[8] % p.ring.capacity
    return frame_bytes(n) if frame_bytes(n) <= rem else rem + frame_bytes(n)


def test_a_frame_round_trips_with_its_kind_and_sequence_number():
    with ring_pair() as p:
        assert p.writer.put(7, b"hello", timeout=1) == 1
        assert p.writer.put(9, b"", timeout=1) == 2
        first, second = p.reader.get(timeout=1), p.reader.get(timeout=1)
        assert (first.kind, first.seq, first.payload) == (7, 1, b"hello")
        assert (second.kind, second.seq, second.payload) == (9, 2, b"")


def test_a_message_larger_than_half_the_ring_is_a_value_error_up_front():
    with ring_pair(capacity=1024) as p:
        limit = p.ring.max_payload
        assert limit == 1024 // 2 - FRAME.size
        p.writer.put(1, bytes(limit), timeout=1)
        with pytest.raises(
            ValueError, match=f"{limit + 1}-byte message exceeds its {limit}-byte limit"
        ):
            p.writer.put(1, bytes(limit + 1), timeout=1)
        assert p.reader.get(timeout=1).payload == bytes(limit)
        assert not p.reader.pending()


def test_a_full_ring_raises_ring_full_at_the_deadline_and_writes_nothing():
    with ring_pair(capacity=256) as p:
        sent = 0
        while p.writer.free_bytes() >= frame_bytes(40):
            p.writer.put(1, bytes([sent]) * 40, timeout=0)
            sent += 1
        used = p.ring.used_bytes()
        with pytest.raises(RingFull) as err:
            p.writer.put(1, bytes(40), timeout=0.02)
        assert isinstance(err.value, queue.Full)
        assert p.ring.used_bytes() == used
        assert [f.payload for f in p.reader.drain()] == [bytes([i]) * 40 for i in range(sent)]
        assert p.writer.put(1, b"after", timeout=0) == sent + 1


def test_an_empty_ring_raises_ring_empty_at_the_deadline():
    with ring_pair() as p, pytest.raises(RingEmpty) as err:
        p.reader.get(timeout=0.01)
    assert isinstance(err.value, queue.Empty)


def test_a_frame_that_does_not_fit_before_the_end_wraps_to_the_start():
    with ring_pair(capacity=1024) as p:
        # Frames of 496 + 496 + 24 bytes leave exactly 8 bytes at the end: room for the
        # wrap marker's length word only.
        for kind, size in ((1, 480), (2, 480), (3, 8)):
            p.writer.put(kind, bytes(size), timeout=0)
            assert p.reader.get(timeout=0).kind == kind
        p.writer.put(4, b"x" * 30, timeout=0)
        frame = p.reader.get(timeout=0)
        assert (frame.kind, frame.payload) == (4, b"x" * 30)
        assert frame.end == 1024 + frame_bytes(30)


def test_commit_is_durable_and_uncommitted_frames_come_again_after_rewind():
    with ring_pair() as p:
        for i in range(5):
            p.writer.put(1, bytes([i]), timeout=0)
        a, b = p.reader.recv(timeout=0), p.reader.recv(timeout=0)
        p.reader.commit(a)
        p.reader.recv(timeout=0)
        p.reader.rewind()
        assert p.reader.recv(timeout=0) == b
        p.reader.commit()
        assert [f.seq for f in p.reader.drain()] == [3, 4, 5]


def test_a_new_consumer_resumes_at_the_committed_tail(run_id):
    with ring_pair(run_id=run_id) as p:
        for i in range(4):
            p.writer.put(1, bytes([i]), timeout=0)
        p.reader.commit(p.reader.recv(timeout=0))
        p.reader.recv(timeout=0)  # read but never committed: the successor must see it
        p.reader.close()  # the predecessor is gone
        successor = RingReader(p.ring, bell=p.consumer_bell, space=p.producer_bell)
        assert [f.seq for f in successor.drain()] == [2, 3, 4]


def test_a_consumer_that_died_between_its_two_commit_stores_redoes_that_frame():
    with ring_pair() as p:
        for i in range(3):
            p.writer.put(1, bytes([i]), timeout=0)
        p.reader.recv(timeout=0)
        p.ring.words[17] = 1  # tail_seq stored, tail not yet: the crash window of commit()
        p.reader.close()  # the predecessor is gone
        successor = RingReader(p.ring, bell=p.consumer_bell, space=p.producer_bell)
        assert [f.seq for f in successor.drain()] == [1, 2, 3]


def test_a_restarted_producer_continues_the_sequence_after_unconsumed_frames():
    with ring_pair() as p:
        for i in range(3):
            p.writer.put(1, bytes([i]), timeout=0)
        p.reader.get(timeout=0)
        p.writer.close()  # the predecessor is gone
        restarted = RingWriter(p.ring, wake=p.consumer_bell, space=p.producer_bell)
        assert restarted.put(1, b"new", timeout=0) == 4
        assert [f.seq for f in p.reader.drain()] == [2, 3, 4]


def test_a_sequence_gap_is_a_protocol_error_and_the_cursor_stays():
    with ring_pair() as p:
        p.writer.put(1, b"a", timeout=0)
        p.writer._next_seq = 5  # a producer that skipped numbers
        p.writer.put(1, b"b", timeout=0)
        assert p.reader.get(timeout=0).seq == 1
        with pytest.raises(ProtocolError, match="sequence gap: expected 2, got 5"):
            p.reader.get(timeout=0)
        with pytest.raises(ProtocolError, match="gap"):
            p.reader.get(timeout=0)


def test_a_duplicate_sequence_number_is_a_protocol_error():
    with ring_pair() as p:
        p.writer.put(1, b"a", timeout=0)
        p.writer._next_seq = 1
        p.writer.put(1, b"b", timeout=0)
        p.reader.get(timeout=0)
        with pytest.raises(ProtocolError, match="sequence duplicate: expected 2, got 1"):
            p.reader.get(timeout=0)


def test_a_frame_that_claims_more_bytes_than_were_published_is_a_protocol_error():
    with ring_pair(capacity=1024) as p:
        p.writer.put(1, b"abc", timeout=0)
        FRAME.pack_into(p.ring.data, 0, 400, 1, 1)
        with pytest.raises(ProtocolError, match="claims 400 bytes"):
            p.reader.get(timeout=0)


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(min_size=8, max_size=600), head=st.integers(min_value=1, max_value=1024))
def test_garbage_in_the_data_area_is_rejected_with_protocol_error_or_read_as_frames(garbage, head):
    with ring_pair(capacity=1024) as p:
        p.ring.data[: len(garbage)] = garbage
        p.ring.words[8] = head  # a producer that published garbage
        for i in range(64):
            try:
                if i % 2:  # the batch reader refuses what the single one does
                    batch = p.reader.take()
                    if batch is None:
                        return
                    frames = batch.frames()
                    p.reader.commit(batch)
                else:
                    frames = [p.reader.get(timeout=0)]
            except (ProtocolError, RingEmpty):
                return
            assert all(len(f.payload) <= p.ring.max_payload for f in frames)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.integers(min_value=0, max_value=236),
            st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=6),
            st.sampled_from(["get", "drain", "take", "take2", "rewind"]),
        ),
        max_size=120,
    )
)
def test_any_interleaving_of_puts_and_gets_delivers_every_frame_once_in_order(ops):
    """Single puts and batches (lists of sizes) against single reads, drains and takes."""
    with ring_pair(capacity=512) as p:
        model: deque[bytes] = deque()
        sent = 0
        for op in ops:
            if isinstance(op, (int, list)):
                sizes = [op] if isinstance(op, int) else op
                batch = [
                    ((sent + i) % 7, struct.pack("<I", sent + i) + bytes([(sent + i) % 251]) * n)
                    for i, n in enumerate(sizes)
                ]
                used = p.ring.used_bytes()
                if sum(frame_bytes(len(b)) for _, b in batch) > p.writer.max_batch:
                    with pytest.raises(ValueError, match="split it"):
                        p.writer.put_many(batch, timeout=0)
                    assert p.ring.used_bytes() == used
                    continue
                try:
                    if isinstance(op, int):
                        assert p.writer.put(*batch[0], timeout=0) == sent + 1
                    else:
                        assert p.writer.put_many(batch, timeout=0) == sent + len(batch)
                except RingFull:
                    assert p.ring.used_bytes() == used  # all or nothing
                    if isinstance(op, int):
                        assert p.writer.free_bytes() < needed_bytes(p, len(batch[0][1]))
                    continue
                model.extend(payload for _, payload in batch)
                sent += len(batch)
            elif op == "get" and model:
                assert p.reader.get(timeout=0).payload == model.popleft()
            elif op == "drain":
                assert [f.payload for f in p.reader.drain()] == list(model)
                model.clear()
            elif op in ("take", "take2"):
                taken = p.reader.take(2 if op == "take2" else 1 << 30)
                if taken is None:
                    assert not model
                    continue
                expected = [model.popleft() for _ in taken.payloads]
                assert taken.payloads == expected
                assert taken.kinds == [struct.unpack_from("<I", x)[0] % 7 for x in expected]
                assert taken.first_seq == struct.unpack_from("<I", expected[0])[0] + 1
                p.reader.commit(taken)
            elif op == "rewind":
                p.reader.rewind()
        assert [f.payload for f in p.reader.drain()] == list(model)


def test_a_batch_is_published_with_one_head_store_and_one_doorbell_ring(monkeypatch):
    with ring_pair(capacity=1024) as p:
        rings = []
        monkeypatch.setattr(p.writer.wake, "ring", lambda: rings.append(p.ring.used_bytes()))
        batch = [(k, bytes([k]) * (40 * k)) for k in range(1, 5)]
        assert p.writer.put_many(batch, timeout=0) == 4
        assert rings == [sum(frame_bytes(40 * k) for k in range(1, 5))]
        taken = p.reader.take()
        assert taken is not None
        assert (taken.kinds, taken.payloads, taken.first_seq) == (
            [1, 2, 3, 4],
            [b for _, b in batch],
            1,
        )
        assert taken.seq == 4 and taken.end == taken.ends[-1] == p.ring.used_bytes()
        assert p.writer.put_many([], timeout=0) == 4  # an empty batch: the last seq so far


def test_a_batch_that_crosses_the_end_of_the_ring_wraps_the_frame_that_does_not_fit():
    with ring_pair(capacity=512) as p:
        for _ in range(2):
            p.writer.put(0, bytes(200), timeout=0)
        p.reader.drain()  # the tail is now at 432: 80 bytes to the end
        batch = [(1, b"a" * 40), (2, b"b" * 40), (3, b"c" * 40)]  # 56 bytes framed each
        assert p.writer.put_many(batch, timeout=0) == 5
        taken = p.reader.take()
        assert taken is not None
        frames = taken.frames()
        assert [(f.kind, f.payload) for f in frames] == batch
        assert [f.end for f in frames] == [488, 512 + 56, 512 + 112]


def test_a_batch_that_does_not_fit_raises_ring_full_at_the_deadline_and_writes_nothing():
    with ring_pair(capacity=512) as p:
        p.writer.put(1, bytes(200), timeout=0)
        p.writer.put(1, bytes(80), timeout=0)  # 312 of 512 bytes used
        used, next_seq = p.ring.used_bytes(), p.writer.next_seq
        batch = [(k, bytes(40)) for k in range(4)]  # 224 bytes framed
        with pytest.raises(RingFull, match="no room for 256 bytes"):  # 224 + 32 skipped to wrap
            p.writer.put_many(batch, timeout=0.02)
        assert (p.ring.used_bytes(), p.writer.next_seq) == (used, next_seq)
        p.reader.get(timeout=0)
        assert p.writer.put_many(batch, timeout=0) == 6


def test_a_batch_over_half_the_ring_or_with_a_bad_frame_is_a_value_error_naming_it():
    with ring_pair(capacity=1024) as p:
        with pytest.raises(ValueError, match=r"batch of 9 frames \(576 bytes framed\) exceeds"):
            p.writer.put_many([(1, bytes(48))] * 9, timeout=0)
        with pytest.raises(ValueError, match="exceeds its 496-byte limit"):
            p.writer.put_many([(1, b"ok"), (1, bytes(497))], timeout=0)
        with pytest.raises(ValueError, match="frame kind -1 outside u32"):
            p.writer.put_many([(1, b"ok"), (-1, b"")], timeout=0)
        assert p.ring.used_bytes() == 0 and p.writer.next_seq == 1


def test_take_returns_the_frames_before_a_refused_one_and_the_next_take_raises():
    with ring_pair(capacity=1024) as p:
        p.writer.put_many([(1, b"one"), (2, b"two")], timeout=0)
        tail = p.ring.used_bytes()
        p.ring.data[tail : tail + 16] = FRAME.pack(8, 0, 99)  # seq 99 where 3 belongs
        p.ring.words[8] = tail + 16 + 8
        taken = p.reader.take()
        assert taken is not None and taken.payloads == [b"one", b"two"]
        with pytest.raises(ProtocolError, match="sequence gap: expected 3, got 99"):
            p.reader.take()
        assert p.reader.skip().seq == 99
        assert p.reader.take() is None


def test_a_second_live_producer_is_refused(run_id):
    with ring_pair(run_id=run_id) as p:
        p.ring.words[9] = 1  # pid 1 (init) is alive and is not us
        p.ring.words[10] = 0
        with pytest.raises(EndpointTaken, match="producer end"):
            RingWriter(p.ring, wake=p.consumer_bell, space=p.producer_bell)


def test_an_end_already_open_in_this_process_is_refused_until_it_is_closed(run_id):
    with ring_pair(run_id=run_id) as p:
        with pytest.raises(EndpointTaken, match=r"consumer end .* this process"):
            RingReader(p.ring, bell=p.consumer_bell, space=p.producer_bell)
        p.reader.close()
        RingReader(p.ring, bell=p.consumer_bell, space=p.producer_bell).close()


def test_attaching_something_that_is_not_a_ring_is_a_layout_error(run_id):
    seg = Segment.create(names.posix_name(run_id, "notring"), HEADER_BYTES + 256)
    try:
        with pytest.raises(SegmentLayoutError, match="not a ringfence ring"):
            Ring.attach(seg.name)
    finally:
        seg.close()
        seg.unlink()


def test_a_ring_capacity_must_be_a_multiple_of_8(run_id):
    with pytest.raises(ValueError, match="multiple of 8"):
        Ring.create(names.posix_name(run_id, "r"), 1001)


def test_a_consumer_that_attaches_by_name_reads_what_the_producer_published(run_id):
    with ring_pair(run_id=run_id) as p:
        p.writer.put(3, b"by name", timeout=0)
        p.reader.close()  # hand the consumer end over
        ring = Ring.attach(p.ring.name)
        bell = Doorbell.attach(p.consumer_bell.name)
        space = Doorbell.attach(p.producer_bell.name)
        try:
            reader = RingReader(ring, bell=bell, space=space)
            assert reader.get(timeout=1) == (3, 1, b"by name", frame_bytes(7))
            assert p.ring.used_bytes() == 0
        finally:
            for obj in (ring, bell, space):
                obj.close()


def test_commits_do_not_wake_a_producer_that_sleeps_for_another_reason(run_id):
    # The producer's one doorbell also serves its own inbox: a commit must ring it only
    # when the producer is waiting for room, or every commit is a wasted wake-up.
    with ring_pair(spin_us=0, run_id=run_id) as p:
        marks = CounterBlock.create(names.posix_name(run_id, "marks"), 3)
        watch = Doorbell.create(names.posix_name(run_id, "watch"))
        sleeper = SPAWN.Process(
            target=peers.count_wakeups, args=(p.producer_bell.name, marks.segment.name, watch.name)
        )
        try:
            for i in range(20):
                p.writer.put(1, bytes([i]), timeout=0)
            sleeper.start()
            marks[2].wait_for(1, timeout=30, bell=watch)
            for _ in range(20):
                p.reader.get(timeout=0)
                # Give a wrongly woken sleeper time to fall asleep again, so that each
                # spurious ring shows up as a wake-up; not a wait for any condition.
                time.sleep(0.001)
            marks[0].advance(1)
            p.producer_bell.ring()
            sleeper.join(30)
            assert sleeper.exitcode == 0
            assert marks[1].value() <= 4, f"the sleeper checked {marks[1].value()} times"
        finally:
            reap(sleeper)
            for obj in (marks, watch):
                obj.close()
                obj.unlink()


def test_a_producer_waiting_for_room_is_woken_by_the_commit_that_frees_it():
    with ring_pair(capacity=256, spin_us=0) as p:
        with pytest.raises(RingFull):
            while True:
                p.writer.put(1, b"full", timeout=0)
        done = threading.Event()

        def put_late():
            p.writer.put(2, b"late", timeout=10)
            done.set()

        putter = threading.Thread(target=put_late)
        putter.start()
        assert not done.wait(0.05)
        p.reader.get(timeout=0)
        assert done.wait(10)
        putter.join(10)
        assert [f.kind for f in p.reader.drain()][-1] == 2

"""Doorbells and watermarks: wake-ups across processes, deadlines, spin back-off, no torn values."""

from __future__ import annotations

import os
import signal
import threading
import time

import multiprocess
import peers
import pytest

from ringfence.actors.tools.testing.shm import reap
from ringfence.shm import names
from ringfence.shm.counter import CounterBlock, wait_or_gone
from ringfence.shm.doorbell import Doorbell, SpinPolicy
from ringfence.shm.errors import ActorDead, SegmentLayoutError, WaitTimeout
from ringfence.shm.segment import Segment

SPAWN = multiprocess.get_context("spawn")


@pytest.fixture
def block(run_id):
    marks = CounterBlock.create(names.posix_name(run_id, "marks"), 4)
    bell = Doorbell.create(names.posix_name(run_id, "bell"))
    yield marks, bell
    for obj in (marks, bell):
        obj.close()
        obj.unlink()


def test_a_watermark_only_moves_forward(block):
    marks, _ = block
    marks[0].advance(5)
    marks[0].advance(5)
    with pytest.raises(ValueError, match="cannot go back from 5 to 4"):
        marks[0].advance(4)
    assert [marks[i].value() for i in range(4)] == [5, 0, 0, 0]


def test_a_counter_keeps_the_doorbells_its_writer_claimed_with(block):
    # claim() through one index expression and advance() through another must ring the
    # same bells: a fresh wrapper per index would drop the list and lose every wake-up.
    marks, bell = block
    marks[2].claim(notify=[bell])
    assert marks[2] is marks[2]
    assert marks[2].notify == (bell,)


def test_waiting_for_a_value_already_reached_returns_at_once(block):
    marks, bell = block
    marks[1].advance(3)
    assert marks[1].wait_for(2, timeout=0, bell=bell) == 3


def test_a_wait_that_times_out_with_a_live_writer_raises_wait_timeout(block):
    marks, bell = block
    marks[0].claim()
    with pytest.raises(WaitTimeout, match=r"at 0 did not reach 1"):
        marks[0].wait_for(1, timeout=0.02, bell=bell)


def test_a_wait_on_a_dead_writer_raises_actor_dead_at_its_deadline(block):
    marks, bell = block
    proc = SPAWN.Process(target=peers.counter_writer, args=(marks.segment.name, bell.name, 3))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    with pytest.raises(ActorDead, match=f"writer pid {proc.pid} is gone"):
        marks[0].wait_for(4 << 32 | 4, timeout=0.05, bell=bell)


def test_a_reader_never_sees_a_torn_counter_value(block):
    # Every value written has equal 32-bit halves; a torn 8-byte store would break that.
    marks, bell = block
    count = 300_000
    proc = SPAWN.Process(target=peers.counter_writer, args=(marks.segment.name, bell.name, count))
    proc.start()
    try:
        mark, reads, last = marks[0], 0, 0
        while last != (count << 32 | count):
            value = mark.value()
            assert value >> 32 == value & 0xFFFFFFFF, f"torn read {value:#x}"
            assert value >= last
            last, reads = value, reads + 1
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        reap(proc)


@pytest.mark.parametrize("spin_us", [0, 50])
def test_a_ping_pong_of_watermarks_never_loses_a_wake_up(run_id, spin_us):
    # Every step needs the other process to wake: with spin 0 each one is a real sleep on
    # the semaphore, and a lost wake-up would stall a wait until its 10 s deadline.
    rounds = 3000
    marks = CounterBlock.create(names.posix_name(run_id, "marks"), 2)
    mine = Doorbell.create(names.posix_name(run_id, "mine"), spin_us=spin_us)
    theirs = Doorbell.create(names.posix_name(run_id, "theirs"))
    proc = SPAWN.Process(
        target=peers.counter_echo,
        args=(marks.segment.name, theirs.name, mine.name, rounds, spin_us),
    )
    try:
        proc.start()
        ping, pong = marks[0], marks[1]
        ping.claim(notify=[theirs])
        for k in range(1, rounds + 1):
            ping.advance(k)
            pong.wait_for(k, timeout=10, bell=mine)
        proc.join(30)
        assert proc.exitcode == 0
    finally:
        reap(proc)
        for obj in (marks, mine, theirs):
            obj.close()
            obj.unlink()


def test_a_doorbell_wakes_a_blocked_thread_and_a_stale_post_is_harmless(run_id):
    bell = Doorbell.create(names.posix_name(run_id, "bell"), spin_us=0)
    try:
        flag = threading.Event()
        bell.ring()  # nobody sleeping: no post

        def wake():
            flag.set()
            bell.ring()

        waker = threading.Timer(0.05, wake)
        waker.start()
        assert bell.wait_until(flag.is_set, timeout=10)
        waker.join()
        assert bell._sem is not None
        bell._sem.release()  # a stale post, as from a producer that raced a re-check
        assert not bell.wait_until(lambda: False, timeout=0.02)
    finally:
        bell.close()
        bell.unlink()


def test_a_producer_posts_once_per_arming_however_often_it_rings(run_id):
    bell = Doorbell.create(names.posix_name(run_id, "bell"), spin_us=0)
    producer = Doorbell.attach(bell.name)
    try:
        sem = bell._sem
        assert sem is not None
        bell._word[0] = 7  # a consumer armed with generation 7
        for _ in range(5):
            producer.ring()
        assert sem.value == 1  # one post wakes that arming; the other four skip the syscall
        bell._word[0] = 8  # it woke and armed again
        producer.ring()
        producer.ring()
        assert sem.value == 2
        bell._word[0] = 0  # awake: nobody to post to
        producer.ring()
        assert sem.value == 2
    finally:
        producer.close()
        bell.close()
        bell.unlink()


def armed_past(bell: Doorbell, generation: int) -> int:
    """Wait (briefly, with a deadline) until ``bell``'s waiter arms after ``generation``."""
    deadline = time.monotonic() + 10
    while not bell._word[0] > generation:
        assert time.monotonic() < deadline, "the waiter never blocked"
        os.sched_yield()
    return int(bell._word[0])


def test_a_waiter_woken_for_one_condition_is_woken_again_for_the_next_by_the_same_producer(
    run_id,
):
    """Each arming is a new generation: were it reused, the producer's second ring would
    be skipped as already posted, and the second wait would sleep to its deadline."""
    bell = Doorbell.create(names.posix_name(run_id, "bell"), spin_us=0)
    producer = Doorbell.attach(bell.name)
    first, second, results = threading.Event(), threading.Event(), []

    def consumer():
        results.append(bell.wait_until(first.is_set, timeout=10))
        results.append(bell.wait_until(second.is_set, timeout=10))

    thread = threading.Thread(target=consumer)
    try:
        thread.start()
        generation = armed_past(bell, 0)
        first.set()
        producer.ring()
        armed_past(bell, generation)
        began = time.monotonic()
        second.set()
        producer.ring()
        thread.join(15)
        assert results == [True, True] and time.monotonic() - began < 5
    finally:
        first.set()
        second.set()
        thread.join(15)
        producer.close()
        bell.close()
        bell.unlink()


def test_the_spin_window_collapses_to_blocking_when_spins_keep_missing_and_probes_again():
    policy = SpinPolicy(spin_us=50)
    assert policy.next_window() == 50_000
    for _ in range(5):
        policy.spun_and_missed()
    assert policy.window_ns == 0
    windows = []
    for _ in range(64):
        windows.append(policy.next_window())
        policy.blocked_waits += 1
    assert windows.count(50_000) == 1 and windows.count(0) == 63
    policy.spun_and_caught(50_000)
    assert policy.next_window() == 50_000


def test_a_negative_spin_window_is_refused():
    with pytest.raises(ValueError, match=r"runtime\.spin_us"):
        SpinPolicy(-1)


def test_attaching_a_segment_that_is_not_a_counter_block_is_a_layout_error(run_id):
    seg = Segment.create(names.posix_name(run_id, "x"), 128)
    try:
        with pytest.raises(SegmentLayoutError, match="not a ringfence counter block"):
            CounterBlock.attach(seg.name)
    finally:
        seg.close()
        seg.unlink()


def test_a_signal_handled_during_a_blocked_wait_is_a_wake_up_not_an_error(run_id):
    """sem_wait is never restarted after a handler ran: the wait re-checks instead of raising."""
    handled = threading.Event()
    previous = signal.signal(signal.SIGUSR1, lambda *_: handled.set())
    bell = Doorbell.create(names.posix_name(run_id, "bell"), spin_us=0)
    main = threading.get_ident()
    sender = threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGUSR1))
    try:
        sender.start()
        assert bell.wait_until(handled.is_set, timeout=30.0)
    finally:
        sender.cancel()
        signal.signal(signal.SIGUSR1, previous)
        bell.close()
        bell.unlink()


def test_waiting_on_watermarks_ends_when_each_short_of_the_target_lost_its_writer(block):
    """A writer that died rings no bell: the wait looks at the writers each ``look_every``
    and ends with the marks still short, long before its deadline (an engine's drain of a
    store lane that stopped first: docs/design.md, "Epochs and restarts")."""
    marks, bell = block
    proc = SPAWN.Process(target=peers.counter_writer, args=(marks.segment.name, bell.name, 3))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    target = 4 << 32 | 4  # past the writer's last value, 3 << 32 | 3
    marks[1].advance(target)  # reached: never waited for
    started = time.monotonic()
    short = wait_or_gone(
        [marks[0], marks[1]], target, timeout=30.0, wait=bell.wait_until, look_every=0.05
    )
    assert short == [marks[0]] and marks[0].writer_gone()
    assert time.monotonic() - started < 10.0, "held to the deadline by a dead writer"


def test_waiting_on_watermarks_keeps_to_the_deadline_while_a_writer_lives(block):
    marks, bell = block
    marks[2].claim()  # this process: alive
    assert wait_or_gone([marks[2]], 1, timeout=0.1, wait=bell.wait_until, look_every=0.02) == [
        marks[2]
    ]
    marks[2].advance(1)
    assert wait_or_gone([marks[2]], 1, timeout=0.0, wait=bell.wait_until, look_every=0.02) == []

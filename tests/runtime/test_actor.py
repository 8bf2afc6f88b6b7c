"""Tests of the Actor base class and the Driver, in one process, on local and ring mailboxes."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest

from ringfence.actors.tools.testing.shm import RingPair, ring_pair
from ringfence.runtime.actor import Actor, handles
from ringfence.runtime.codec import Registry, make_kind, message
from ringfence.runtime.config import RuntimeConfig
from ringfence.runtime.control import InstanceControl
from ringfence.runtime.driver import BATCH, Driver
from ringfence.runtime.log import ActorLog
from ringfence.runtime.mailbox import (
    ConditionWaiter,
    Delivery,
    LocalInbox,
    LocalOutbox,
    Mailbox,
    PollWaiter,
    RingInbox,
    RingOutbox,
    Waiter,
)
from ringfence.runtime.messages import Failed, Stop, Tick
from ringfence.shm.errors import ActorDead, ProtocolError, RingFull
from ringfence.shm.ring_reader import Batch, Frame, Skipped

PROTO = Registry("host->x", verify=True)


@message(PROTO, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class Item:
    n: int  # a negative n makes the handler raise ValueError


@message(PROTO, tag=2)
@dataclass(frozen=True, slots=True, kw_only=True)
class Ask:
    expects_reply: ClassVar[bool] = True
    n: int  # as Item.n


@message(PROTO, tag=3)
@dataclass(frozen=True, slots=True, kw_only=True)
class Later:
    delay_s: float  # the handler schedules Item(n=n) this far ahead
    n: int


@message(PROTO, tag=4)
@dataclass(frozen=True, slots=True, kw_only=True)
class Orphan:
    expects_reply: ClassVar[bool] = True
    n: int  # no actor here handles this type


class Recorder(Actor):
    """Records its hooks and messages in order, and when each Item was handled."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.seen: list[object] = []
        self.at: dict[int, float] = {}  # Item.n -> time.monotonic() when it was handled
        self.scheduled_at = 0.0  # time.monotonic() when the last Later was handled
        self.failed: list[tuple[Exception, Delivery]] = []

    def on_start(self) -> None:
        self.seen.append("start")

    def on_stop(self) -> None:
        self.seen.append("stop")

    def on_failure(self, error: Exception, delivery: Delivery) -> None:
        self.failed.append((error, delivery))

    @handles(Item, Ask)
    def on_item(self, msg: Item | Ask) -> None:
        self.seen.append(msg)
        self.at[msg.n] = time.monotonic()
        if msg.n < 0:
            raise ValueError(f"negative n {msg.n}")

    @handles(Later)
    def on_later(self, msg: Later) -> None:
        self.seen.append(msg)
        self.scheduled_at = time.monotonic()
        self.schedule(msg.delay_s, Item(n=msg.n))


class Fatal(Recorder):
    def on_failure(self, error: Exception, delivery: Delivery) -> None:
        super().on_failure(error, delivery)
        raise error  # every handler failure ends the instance


class Ticker(Recorder):
    tick_s = 0.01

    @handles(Tick)
    def on_tick(self, msg: Tick) -> None:
        self.seen.append(msg)


class SleepSignal(ConditionWaiter):
    """A waiter that sets ``sleeping`` whenever the mailbox goes to sleep on it."""

    def __init__(self) -> None:
        super().__init__()
        self.sleeping = threading.Event()

    def wait_until(self, ready: Callable[[], bool], timeout: float) -> bool:
        self.sleeping.set()
        return super().wait_until(ready, timeout)


class Word:
    """A control watermark stand-in that records what it is advanced to."""

    def __init__(self, fails: bool) -> None:
        self.values: list[int] = []
        self.fails = fails

    def value(self) -> int:
        return self.values[-1] if self.values else 0

    def advance(self, value: int) -> None:
        if self.fails:
            raise OSError("control block unmapped")
        self.values.append(value)


def fake_control(failing: str = "") -> Any:
    return InstanceControl._make(Word(name == failing) for name in InstanceControl._fields)


SLOW_BEAT = RuntimeConfig(heartbeat_s=60.0, heartbeat_timeout_s=120.0)  # run() sleeps 60 s
STOP_FIELDS = ("reason", "handled", "failures", "error")
FAILED_FIELDS = ("peer", "seq", "type", "error", "message", "replied")


def pick(line: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: line[k] for k in keys}


def drain(inbox: LocalInbox) -> list[Any]:
    """The messages waiting in ``inbox``, taken out."""
    return [d.msg for d in iter(inbox.read, None)]


@dataclass
class Rig:
    """A driver for "x-0" fed by "host" (``inbox``), answering "host" into ``replies``."""

    driver: Driver
    inbox: LocalInbox | None  # None when the "host" inbox is a ring
    replies: LocalInbox
    log_path: Path

    @property
    def actor(self) -> Any:
        return self.driver.actor

    def post(self, *msgs: object) -> None:
        assert self.inbox is not None
        for msg in msgs:
            self.inbox.post(msg)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        lines = [orjson.loads(line) for line in self.log_path.read_bytes().splitlines()]
        return [line for line in lines if name in (None, line["event"])]

    def add_peers(self, *peers: str) -> dict[str, LocalInbox]:
        """An outbox to each of ``peers``, each into a fresh inbox; the inboxes by peer."""
        inboxes = {}
        for peer in peers:
            inboxes[peer] = Mailbox(ConditionWaiter()).add_local_inbox("x-0", PROTO)
            self.driver.mailbox.outboxes[peer] = LocalOutbox(peer, inboxes[peer])
        return inboxes


@pytest.fixture
def ring() -> Iterator[RingPair]:
    with ring_pair() as pair:
        yield pair


@pytest.fixture
def make_rig(tmp_path) -> Iterator[Callable[..., Rig]]:
    """Builds rigs; closes their drivers at the end of the test (before ``ring`` goes)."""
    drivers: list[Driver] = []

    def make(
        actor_cls: type[Actor],
        *,
        level: str = "info",
        ring: RingPair | None = None,
        waiter: Waiter | None = None,
        runtime: RuntimeConfig = RuntimeConfig(),  # noqa: B008 - frozen
        control: Any = None,
    ) -> Rig:
        mailbox = Mailbox(waiter or (ring.consumer_bell if ring else ConditionWaiter()))
        inbox = None if ring else mailbox.add_local_inbox("host", PROTO)
        if ring:
            mailbox.inboxes.append(RingInbox("host", ring.reader, PROTO))
        replies = Mailbox(ConditionWaiter()).add_local_inbox("x-0", PROTO)
        mailbox.outboxes["host"] = LocalOutbox("host", replies)
        log = ActorLog(tmp_path / "x-0.jsonl", actor="x", rank=0, epoch=0, level=level)
        kwargs = {"mailbox": mailbox, "runtime": runtime, "log": log, "control": control}
        drivers.append(Driver(actor_cls, name="x", rank=0, **kwargs))
        return Rig(drivers[-1], inbox, replies, tmp_path / "x-0.jsonl")

    yield make
    for driver in drivers:
        driver.close()


def poll_until(driver: Driver, done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``driver`` (which sleeps until its next timer) until ``done()``, up to a deadline."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        driver.poll(0.5)


def define(**body: Any) -> type[Actor]:
    return type("Bad", (Actor,), body)


# The handler table.


def test_the_handler_table_is_built_when_the_class_is_created():
    assert Actor.handlers == {Stop: "handle_stop", Failed: "handle_failed"}
    assert "handlers" in vars(Recorder)
    assert Recorder.handlers == {
        Stop: "handle_stop",
        Failed: "handle_failed",
        Item: "on_item",
        Ask: "on_item",
        Later: "on_later",
    }


TAKES = r"Bad\.h: a handler takes \(self, msg\), got "
BAD_CLASSES: dict[str, tuple[Callable[[], dict[str, Any]], str]] = {
    "no msg": (lambda: {"h": handles(Item)(lambda self: None)}, TAKES + r"\(self\)"),
    "extra": (lambda: {"h": handles(Item)(lambda self, m, x: None)}, TAKES + r"\(self, m, x\)"),
    "varargs": (lambda: {"h": handles(Item)(lambda self, *ms: None)}, TAKES + r"\(self, \*ms\)"),
    "kw-only": (lambda: {"h": handles(Item)(lambda self, *, m: None)}, TAKES + r"\(self, \*, m\)"),
    "not a dataclass": (
        lambda: {"h": handles(int)(lambda self, m: None)},
        r"Bad\.h: @handles\(<class 'int'>\): not a message dataclass",
    ),
    "a type twice": (
        lambda: {"a": handles(Item)(lambda s, m: None), "b": handles(Ask, Item)(lambda s, m: None)},
        r"Bad: Item is handled by both a and b",
    ),
    "no type": (lambda: {"h": handles()(lambda self, m: None)}, r"@handles needs at least one "),
    "tick 0": (lambda: {"tick_s": 0.0}, r"Bad\.tick_s must be > 0 or None"),
    "tick < 0": (lambda: {"tick_s": -1.0}, r"Bad\.tick_s must be > 0 or None"),
}


@pytest.mark.parametrize(("body", "error"), BAD_CLASSES.values(), ids=BAD_CLASSES.keys())
def test_a_bad_actor_class_is_a_type_error_when_it_is_created(body, error):
    with pytest.raises(TypeError, match=f"^{error}"):
        define(**body())


def test_tick_s_without_a_tick_handler_is_a_type_error_when_the_class_is_created():
    with pytest.raises(TypeError, match="Tick"):
        define(tick_s=0.5)


def test_a_subclass_overrides_a_handler_by_handling_the_same_type(make_rig):
    class Loud(Recorder):
        @handles(Item)
        def on_item_loudly(self, msg: Item) -> None:
            self.seen.append(("loud", msg.n))

    assert (Loud.handlers[Item], Loud.handlers[Ask]) == ("on_item_loudly", "on_item")
    rig = make_rig(Loud)
    rig.post(Item(n=1), Ask(n=2))
    rig.driver.poll(0)
    assert rig.actor.seen == ["start", ("loud", 1), Ask(n=2)]


def test_a_subclass_overrides_a_handler_by_redefining_the_method(make_rig):
    class Quiet(Recorder):
        def on_item(self, msg: Item | Ask) -> None:
            self.seen.append(("quiet", msg.n))

    assert Quiet.handlers == Recorder.handlers
    rig = make_rig(Quiet)
    rig.post(Item(n=1), Ask(n=2))
    rig.driver.poll(0)
    assert rig.actor.seen == ["start", ("quiet", 1), ("quiet", 2)]


# Dispatch and lifecycle.


def test_poll_starts_the_actor_once_then_hands_over_messages_in_posted_order(make_rig):
    rig = make_rig(Recorder)
    msgs = [Item(n=i) if i % 2 else Ask(n=i) for i in range(BATCH + 6)]
    rig.post(*msgs[:3])
    assert [rig.driver.poll(0), rig.driver.poll(0)] == [3, 0]
    assert rig.actor.seen == ["start", *msgs[:3]]
    rig.post(*msgs[3:])
    assert [rig.driver.poll(0), rig.driver.poll(0), rig.driver.poll(0)] == [BATCH, 3, 0]
    assert rig.actor.seen == ["start", *msgs]
    assert (rig.driver.handled, rig.driver.failures) == (len(msgs), 0)
    [start] = rig.events("actor.start")
    assert pick(start, ("incarnation", "placement", "target", "inboxes", "outboxes")) == {
        "incarnation": 1,
        "placement": "local",
        "target": f"{Recorder.__module__}:Recorder",
        "inboxes": ["host"],
        "outboxes": ["host"],
    }


def test_stop_from_another_thread_wakes_a_run_asleep_in_its_wait(make_rig):
    waiter = SleepSignal()
    rig = make_rig(Recorder, waiter=waiter, runtime=SLOW_BEAT)
    reasons: list[str] = []
    thread = threading.Thread(target=lambda: reasons.append(rig.driver.run()))
    thread.start()
    assert waiter.sleeping.wait(5)
    rig.driver.stop("enough")
    rig.driver.stop("a second reason is ignored")
    thread.join(5)  # without the wake-up, run() would sleep for 60 s
    assert (thread.is_alive(), reasons) == (False, ["enough"])
    rig.driver.close()
    assert rig.actor.seen == ["start", "stop"]
    assert [pick(x, STOP_FIELDS) for x in rig.events("actor.stop")] == [
        {"reason": "enough", "handled": 0, "failures": 0, "error": None}
    ]


def test_start_thread_runs_the_actor_until_stop_and_join(make_rig):
    waiter = SleepSignal()
    rig = make_rig(Recorder, waiter=waiter, runtime=SLOW_BEAT)
    assert rig.driver.join(0) is False
    rig.post(Item(n=1))
    thread = rig.driver.start_thread()
    assert (thread.name, thread.daemon) == ("ringfence-x-0", True)
    assert waiter.sleeping.wait(5)  # the loop sleeps only once the Item is handled
    with pytest.raises(RuntimeError, match=r"^x-0 already runs in ringfence-x-0$"):
        rig.driver.start_thread()
    rig.driver.stop("done")
    assert rig.driver.join(5)
    assert (rig.driver.stop_reason, rig.driver.closed) == ("done", True)
    assert rig.actor.seen == ["start", Item(n=1), "stop"]


class Deaf(SleepSignal):
    """A doorbell whose rings do not arrive while ``deaf``: a mailbox blocked on it sleeps
    out its wait."""

    def __init__(self) -> None:
        super().__init__()
        self.deaf = True
        self.rings = 0

    def ring(self) -> None:
        self.rings += 1
        if not self.deaf:
            super().ring()


@pytest.mark.parametrize("wait", ["block", "poll"])
def test_runtime_wait_poll_looks_at_the_inboxes_between_sleeps_block_waits_for_a_ring(
    make_rig, wait
):
    waiter = Deaf()
    rig = make_rig(Recorder, waiter=waiter, runtime=dataclasses.replace(SLOW_BEAT, wait=wait))
    assert isinstance(rig.driver.mailbox.waiter, PollWaiter) == (wait == "poll")
    rig.driver.start_thread()
    try:
        if wait == "block":  # the loop is asleep on the deaf doorbell (poll sleeps without it)
            assert waiter.sleeping.wait(5)
        rig.post(Item(n=1))
        seen = rig.driver.wait_until(lambda: Item(n=1) in rig.actor.seen, 1.0)
        assert seen == (wait == "poll")  # blocked, the loop sleeps on until a ring or 60 s
    finally:
        waiter.deaf = False
        rig.driver.stop("done")
        assert rig.driver.join(5)


def test_a_poll_waiter_returns_when_ready_or_at_its_deadline_and_passes_rings_on():
    inner = Deaf()
    poll = PollWaiter(inner, period_s=0.001)
    flag = threading.Event()
    timer = threading.Timer(0.05, flag.set)
    timer.start()
    assert poll.wait_until(flag.is_set, 5.0)  # no ring: it saw the flag on a look
    timer.join(5)
    started = time.monotonic()
    assert not poll.wait_until(lambda: False, 0.05)
    assert 0.05 <= time.monotonic() - started < 5.0
    poll.ring()
    assert inner.rings == 1


def test_the_stop_message_ends_run_with_its_reason_before_later_messages(make_rig):
    rig = make_rig(Recorder)
    rig.post(Item(n=1), Stop(reason="bye"), Item(n=2))
    assert rig.driver.run() == "bye"
    assert (rig.actor.seen, rig.driver.handled) == (["start", Item(n=1), "stop"], 2)
    assert (rig.driver.mailbox.inboxes, rig.driver.poll(0)) == ([], 0)  # closed


def test_request_shutdown_without_a_control_block_stops_the_local_driver(make_rig):
    rig = make_rig(Recorder)
    rig.actor.request_shutdown("workload done")
    assert rig.driver.run() == "workload done"
    assert rig.actor.seen == ["start", "stop"]
    assert [x["reason"] for x in rig.events("run.shutdown_requested")] == ["workload done"]


def test_a_control_block_hears_ready_a_beat_a_shutdown_request_and_a_clean_exit(make_rig):
    control = fake_control()
    rig = make_rig(Recorder, control=control)
    rig.actor.request_shutdown("workload done")  # the supervisor decides; the actor goes on
    rig.post(Item(n=1), Stop(reason="bye"))
    assert rig.driver.run() == "bye"
    assert rig.actor.seen == ["start", Item(n=1), "stop"]
    values = {name: getattr(control, name).values for name in InstanceControl._fields}
    assert values == {
        "epoch": [],
        "heartbeat": [1],
        "ready": [1],
        "exited": [1],
        "shutdown": [1],
        "failed": [],  # a hosted one's host writes it (hosting.py), never the driver
        "wanted": [],  # the supervisor's
    }


class Slow(Recorder):
    @handles(Item, Ask)
    def on_item(self, msg: Item | Ask) -> None:
        super().on_item(msg)
        threading.Event().wait(0.02)  # slow work, longer than a heartbeat period


def test_heartbeats_go_on_between_slow_messages_handled_in_one_drain(make_rig):
    control = fake_control()
    beat = RuntimeConfig(heartbeat_s=0.005, heartbeat_timeout_s=0.05)
    rig = make_rig(Slow, control=control, runtime=beat)
    rig.post(*(Item(n=n) for n in range(10)))
    assert rig.driver.poll(0) == 10  # one drain handles all ten
    assert len(control.heartbeat.values) >= 9, "a run of slow messages looked like a hang"


# Failures.


def test_a_failing_handler_is_logged_answered_if_a_reply_is_expected_and_survived(make_rig):
    rig = make_rig(Recorder)
    rig.post(Item(n=-1), Ask(n=-2), Item(n=3))
    assert rig.driver.poll(0) == 3
    assert rig.actor.seen == ["start", Item(n=-1), Ask(n=-2), Item(n=3)]
    assert (rig.driver.handled, rig.driver.failures) == (3, 2)
    reply = Failed(seq=2, type="Ask", error="ValueError", message="negative n -2")
    assert drain(rig.replies) == [reply]
    assert [(type(e), str(e), d) for e, d in rig.actor.failed] == [
        (ValueError, "negative n -1", Delivery("host", 1, Item(n=-1), None)),
        (ValueError, "negative n -2", Delivery("host", 2, Ask(n=-2), None)),
    ]
    lines = rig.events("msg.failed")
    assert [pick(x, ("level", *FAILED_FIELDS)) for x in lines] == [
        {"level": "error", "peer": "host", "seq": 1, "type": "Item", "error": "ValueError",
         "message": "negative n -1", "replied": False},
        {"level": "error", "peer": "host", "seq": 2, "type": "Ask", "error": "ValueError",
         "message": "negative n -2", "replied": True},
    ]  # fmt: skip
    for line, n in zip(lines, (-1, -2), strict=True):
        assert line["exception"].startswith("Traceback (most recent call last):\n")
        assert line["exception"].endswith(f"ValueError: negative n {n}")


def test_a_message_without_a_handler_is_answered_with_a_protocol_error(make_rig):
    rig = make_rig(Recorder)
    rig.post(Orphan(n=1))
    assert rig.driver.poll(0) == 1
    message = "x-0: no handler for Orphan"
    assert drain(rig.replies) == [
        Failed(seq=1, type="Orphan", error="ProtocolError", message=message)
    ]
    assert [x["replied"] for x in rig.events("msg.failed")] == [True]


def test_a_failed_reply_from_a_peer_is_logged_as_refused_and_never_answered(make_rig):
    rig = make_rig(Recorder)
    rig.post(Failed(seq=7, type="Item", error="OutOfBlocks", message="no room"))
    assert rig.driver.poll(0) == 1
    assert drain(rig.replies) == []
    assert [pick(x, ("level", *FAILED_FIELDS[:5])) for x in rig.events("msg.refused")] == [
        {"level": "warning", "peer": "host", "seq": 7, "type": "Item", "error": "OutOfBlocks",
         "message": "no room"}
    ]  # fmt: skip


def test_an_on_failure_that_raises_ends_run_with_that_error_and_no_on_stop(make_rig):
    rig = make_rig(Fatal)
    rig.post(Item(n=-1), Item(n=2))
    with pytest.raises(ValueError, match=r"^negative n -1$") as raised:
        rig.driver.run()
    assert rig.driver.error is raised.value
    assert rig.actor.seen == ["start", Item(n=-1)]
    assert (rig.driver.stop_reason, rig.driver.closed) == ("failed", True)
    assert (rig.driver.mailbox.inboxes, rig.driver.mailbox.outboxes) == ([], {})
    [failed] = rig.events("actor.failed")
    error = "ValueError('negative n -1')"
    assert pick(failed, ("level", "where", "error")) == {
        "level": "error",
        "where": "loop",
        "error": error,
    }
    assert failed["exception"].endswith("ValueError: negative n -1")
    assert [pick(x, STOP_FIELDS) for x in rig.events("actor.stop")] == [
        {"reason": "failed", "handled": 1, "failures": 1, "error": error}
    ]


def test_an_on_start_that_raises_ends_run_with_that_error_before_any_message(make_rig):
    class BadStart(Recorder):
        def on_start(self) -> None:
            raise RuntimeError("no model")

    rig = make_rig(BadStart, control=fake_control())
    rig.post(Item(n=1))
    with pytest.raises(RuntimeError, match=r"^no model$"):
        rig.driver.run()
    assert (rig.actor.seen, rig.driver.handled) == ([], 0)
    assert [x["where"] for x in rig.events("actor.failed")] == ["on_start"]
    assert [x["reason"] for x in rig.events("actor.stop")] == ["failed"]
    assert (rig.driver.ctx.services, rig.driver.ctx.counters) == (rig.driver, {})


def test_an_error_in_start_after_on_start_is_recorded_and_reports_no_exit(make_rig):
    control = fake_control(failing="ready")
    rig = make_rig(Recorder, control=control)
    with pytest.raises(OSError, match=r"^control block unmapped$") as raised:
        rig.driver.run()
    assert (rig.driver.error, control.exited.values) == (raised.value, [])
    assert [x["event"] for x in rig.events("actor.failed")] == ["actor.failed"]


def test_run_returns_normally_only_when_the_instance_did_not_fail(make_rig):
    class BadStop(Recorder):
        def on_stop(self) -> None:
            raise RuntimeError("flush failed")

    rig = make_rig(BadStop)
    rig.post(Stop(reason="bye"))
    try:
        returned = rig.driver.run() == "bye"
    except RuntimeError:
        returned = False
    assert [x["where"] for x in rig.events("actor.failed")] == ["on_stop"]
    assert returned == (rig.driver.error is None)


# Ring inboxes: malformed frames and durable consumption.


def test_a_malformed_ring_frame_is_answered_logged_committed_and_survived(ring, make_rig):
    rig = make_rig(Recorder, ring=ring)
    ring.writer.put(PROTO.encode(Item(n=0))[0], b"{not json", timeout=1)
    ring.writer.put(make_kind(0x777, 1), b"{}", timeout=1)
    ring.writer.put(*PROTO.encode(Item(n=3)), timeout=1)
    assert rig.driver.poll(0) == 3
    ring.reader.rewind()
    assert not ring.reader.pending()  # all three frames were committed
    rig.driver.close()
    assert rig.actor.seen == ["start", Item(n=3), "stop"]
    replies = drain(rig.replies)
    assert [(r.seq, r.type, r.error) for r in replies] == [
        (1, "tag 1", "ProtocolError"),
        (2, "tag 1911", "ProtocolError"),
    ]
    assert replies[0].message.startswith("host->x: tag 1 (Item v1): payload is not valid JSON")
    assert replies[1].message == "host->x: unknown tag 1911 (kind 0x7770001)"
    lines = rig.events("msg.failed")
    assert [pick(x, FAILED_FIELDS) for x in lines] == [
        {"peer": "host", "seq": r.seq, "type": r.type, "error": "ProtocolError",
         "message": r.message, "replied": True}
        for r in replies
    ]  # fmt: skip
    assert [x for x in lines if "exception" in x] == []
    assert [(type(e), d.peer, d.seq, d.msg, d.error) for e, d in rig.actor.failed] == [
        (ProtocolError, "host", seq, None, e) for seq, (e, _) in enumerate(rig.actor.failed, 1)
    ]


def test_a_ring_frame_whose_handler_crashed_comes_again_after_a_restart(ring, make_rig):
    first = make_rig(Fatal, ring=ring)
    seq = ring.writer.put(*PROTO.encode(Item(n=-1)), timeout=1)
    with pytest.raises(ValueError, match=r"^negative n -1$"):
        first.driver.run()
    ring.reader.rewind()  # what the reader of a restarted instance does first
    second = make_rig(Recorder, ring=ring)
    assert second.driver.poll(0) == 1
    assert [d for _, d in second.actor.failed] == [Delivery("host", seq, Item(n=-1), None)]
    ring.reader.rewind()
    assert not ring.reader.pending()  # the survivor committed it
    second.driver.close()


class Peeker(Recorder):
    """Records, while it handles each Item, the next message from the host read ahead."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.ahead: list[object | None] = []

    @handles(Item, Ask)
    def on_item(self, msg: Item | Ask) -> None:
        self.ahead.append(self.peek("host"))
        super().on_item(msg)


def put_items(ring: RingPair, *ns: int) -> None:
    for n in ns:
        ring.writer.put(*PROTO.encode(Item(n=n)), timeout=1)


def got(delivery: Delivery | None) -> Delivery:
    assert delivery is not None
    return delivery


def test_a_frame_read_ahead_is_handed_out_next_and_released_only_after_its_own_turn(ring):
    inbox = RingInbox("host", ring.reader, PROTO)
    put_items(ring, 1, 2, 3)
    first = got(inbox.read())
    ahead = got(inbox.peek())
    assert (first.msg, ahead.msg) == (Item(n=1), Item(n=2))
    assert inbox.peek() is ahead  # read once: peeking again reads nothing more
    inbox.commit()  # the first one's handler ran
    # A crash now: the restarted reader starts from what was committed, so the frame read
    # ahead comes again (committing everything read so far would lose it).
    ring.reader.rewind()
    again = RingInbox("host", ring.reader, PROTO)
    assert [got(again.read()).msg for _ in range(2)] == [Item(n=2), Item(n=3)]


def test_the_next_read_hands_out_what_was_read_ahead_and_a_redelivery_drops_it(ring):
    inbox = RingInbox("host", ring.reader, PROTO)
    put_items(ring, 1, 2, 3)
    first = got(inbox.read())
    ahead = got(inbox.peek())
    assert inbox.pending()
    assert inbox.read() is ahead
    inbox.commit()
    assert got(inbox.read()).msg == Item(n=3)
    inbox.redeliver(first)  # blocked downstream: the uncommitted one comes again
    assert got(inbox.peek()).msg == Item(n=3)
    inbox.redeliver(first)  # what was read ahead is dropped with it, and read again
    assert [got(inbox.read()).msg, inbox.read()] == [Item(n=3), None]


def test_nothing_is_read_ahead_past_a_refused_frame_until_it_is_committed():
    class Refusing:  # a reader whose next frame is malformed, then one good frame
        def __init__(self) -> None:
            self.refuse, self.given = True, False
            self.commits: list[Any] = []

        def poll(self) -> Any:
            if self.refuse:
                raise ProtocolError("ring r: sequence gap")
            if self.given:
                return None
            self.given = True
            kind, payload = PROTO.encode(Item(n=5))
            return Frame(kind, 9, payload, 64)

        def skip(self) -> Any:
            self.refuse = False
            return Skipped(0, 24)

        def commit(self, frame: Any = None) -> None:
            self.commits.append(frame)

        def pending(self) -> bool:
            return True

    reader = Refusing()
    inbox = RingInbox("host", reader, PROTO)  # type: ignore[arg-type]
    assert inbox.peek() is None  # refused now: read() skips it, as it would have
    refused = inbox.read()
    assert refused is not None and refused.error is not None
    assert inbox.peek() is None  # past it only once it is committed: no frame to stop at
    inbox.commit()
    assert reader.commits == [None]  # everything read so far: the refused frame
    assert got(inbox.peek()).msg == Item(n=5)


def test_an_actor_peeks_at_the_next_ring_message_and_each_is_handled_once_in_order(ring, make_rig):
    rig = make_rig(Peeker, ring=ring)
    put_items(ring, 1, 2, 3)
    assert rig.driver.poll(0) == 3
    ring.reader.rewind()
    assert not ring.reader.pending()  # all three committed once handled
    assert rig.actor.seen == ["start", Item(n=1), Item(n=2), Item(n=3)]
    assert rig.actor.ahead == [Item(n=2), Item(n=3), None]


# Timers.


def test_a_timer_of_zero_runs_after_the_messages_already_queued(make_rig):
    rig = make_rig(Recorder)
    rig.post(Later(delay_s=0.0, n=9), Item(n=1), Item(n=2))
    assert rig.driver.poll(0) == 4
    assert rig.actor.seen == ["start", Later(delay_s=0.0, n=9), Item(n=1), Item(n=2), Item(n=9)]


def test_a_timer_does_not_fire_before_its_delay(make_rig):
    rig = make_rig(Recorder)
    rig.post(Later(delay_s=0.05, n=9))
    poll_until(rig.driver, lambda: 9 in rig.actor.at)
    assert rig.actor.at[9] >= rig.actor.scheduled_at + 0.05


def test_ticks_arrive_numbered_from_one(make_rig):
    rig = make_rig(Ticker)
    poll_until(rig.driver, lambda: len(rig.actor.seen) >= 4)
    assert [(type(t), t.n) for t in rig.actor.seen[1:]] == [(Tick, 1), (Tick, 2), (Tick, 3)]
    assert all(t.late_s >= 0 for t in rig.actor.seen[1:])


def test_scheduling_a_message_without_a_handler_is_a_protocol_error(make_rig):
    rig = make_rig(Recorder)
    with pytest.raises(ProtocolError, match=r"^x-0: no handler for Orphan$"):
        rig.actor.schedule(0.0, Orphan(n=1))


# Sending.


@pytest.mark.parametrize(
    ("to", "peer"), [("sink-1", "sink-1"), ("relay", "relay-3"), ("host", "host")]
)
def test_send_routes_to_the_instance_or_to_the_only_instance_of_the_actor(make_rig, to, peer):
    rig = make_rig(Recorder)
    inboxes = {"host": rig.replies, **rig.add_peers("sink-0", "sink-1", "relay-3")}
    assert [rig.actor.send(to, Item(n=1)), rig.actor.send(to, Item(n=2))] == [1, 2]
    received = {name: drain(inbox) for name, inbox in inboxes.items()}
    assert received == {name: [Item(n=1), Item(n=2)] if name == peer else [] for name in inboxes}


def test_send_to_an_actor_with_several_ranks_names_them_and_never_picks_one(make_rig):
    """An executor of rank 0 sending to "sink" must not silently reach sink-0 alone."""
    rig = make_rig(Recorder)
    inboxes = rig.add_peers("sink-0", "sink-1")
    with pytest.raises(KeyError) as raised:
        rig.actor.send("sink", Item(n=1))
    assert raised.value.args == (
        "x-0: 'sink' has 2 ranks here (sink-0, sink-1): name one, or send to all of them",
    )
    assert {name: drain(inbox) for name, inbox in inboxes.items()} == {"sink-0": [], "sink-1": []}


def test_send_all_reaches_every_rank_in_rank_order(make_rig):
    rig = make_rig(Recorder)
    inboxes = rig.add_peers("sink-10", "sink-2", "sink-0", "relay-1")
    assert rig.driver.peers("sink") == ["sink-0", "sink-2", "sink-10"]
    assert rig.actor.send_all("sink", Item(n=5)) == [1, 1, 1]
    received = {name: drain(inbox) for name, inbox in inboxes.items()}
    assert received == {"sink-10": [Item(n=5)], "sink-2": [Item(n=5)], "sink-0": [Item(n=5)],
                        "relay-1": []}  # fmt: skip


def test_send_many_and_send_all_many_deliver_in_order_with_consecutive_seqs(make_rig):
    rig = make_rig(Recorder)
    inboxes = rig.add_peers("sink-1", "sink-0", "relay-0")
    items = [Item(n=n) for n in range(5)]
    assert rig.actor.send_many("relay", items) == [1, 2, 3, 4, 5]
    assert rig.actor.send_all_many("sink", items[:2]) == [[1, 2], [1, 2]]
    assert rig.actor.send_all_many("sink", items[2:]) == [[3, 4, 5], [3, 4, 5]]
    received = {name: drain(inbox) for name, inbox in inboxes.items()}
    assert received == {"sink-1": items, "sink-0": items, "relay-0": items}


def decoded(batch: Batch) -> list[object]:
    return [PROTO.decode(k, p) for k, p in zip(batch.kinds, batch.payloads, strict=True)]


def test_a_ring_outbox_sends_many_in_batches_under_the_ring_limit_one_doorbell_ring_each(
    ring, monkeypatch
):
    outbox = RingOutbox("host", ring.writer, PROTO)
    rings: list[int] = []
    monkeypatch.setattr(ring.writer.wake, "ring", lambda: rings.append(ring.ring.used_bytes()))
    items = [Item(n=n) for n in range(1000, 1100)]  # 100 frames of 32 bytes: 3,200 of 4,096
    framed = 16 + (len(outbox.encode(items[0])[1]) + 7) // 8 * 8
    per_batch = ring.writer.max_batch // framed
    assert outbox.send_many(items, timeout=0) == list(range(1, 101))
    assert rings == [framed * min(100, k) for k in range(per_batch, 100 + per_batch, per_batch)]
    batch = ring.reader.take()
    assert batch is not None and batch.first_seq == 1
    assert decoded(batch) == items
    ring.reader.commit(batch)


def test_a_ring_outbox_that_fills_part_way_says_how_many_messages_went(ring):
    outbox = RingOutbox("host", ring.writer, PROTO)
    items = [Item(n=n) for n in range(1000, 1200)]  # 6,400 bytes framed: over the 4,096
    with pytest.raises(RingFull) as raised:
        outbox.send_many(items, timeout=0)
    sent = raised.value.sent
    assert 0 < sent < len(items)
    batch = ring.reader.take()
    assert batch is not None
    assert decoded(batch) == items[:sent]
    ring.reader.commit(batch)
    assert outbox.send_many(items[sent:], timeout=0)[0] == sent + 1  # the rest, in order


@pytest.mark.parametrize("to", ["nobody", "tap-3"])
def test_send_to_an_unknown_peer_is_a_key_error_listing_the_outboxes(make_rig, to):
    rig = make_rig(Recorder)
    rig.add_peers("tap-1", "tap-2")
    with pytest.raises(KeyError) as raised:
        rig.actor.send(to, Item(n=1))
    assert raised.value.args == (f"x-0 has no outbox to {to!r}: ['host', 'tap-1', 'tap-2']",)


@pytest.mark.parametrize("level", ["trace", "info"])
def test_messages_received_and_sent_are_traced_only_at_level_trace(make_rig, level):
    rig = make_rig(Recorder, level=level)
    rig.add_peers("sink-0")
    rig.post(Item(n=1))
    rig.driver.poll(0)
    rig.actor.send("sink-0", Item(n=2))
    rig.driver.close()
    traced = [x for x in rig.events() if x["event"] in ("msg.recv", "msg.send")]
    expected = [
        {"event": "msg.recv", "level": "trace", "peer": "host", "seq": 1, "type": "Item"},
        {"event": "msg.send", "level": "trace", "peer": "sink-0", "seq": 1, "type": "Item"},
    ]
    assert [pick(x, tuple(expected[0])) for x in traced] == (expected if level == "trace" else [])


class BlockedOutbox:
    """An outbox to "down" that raises ``errors`` one by one before it lets sends through."""

    def __init__(self, peer: str, target: LocalInbox, errors: list[Exception]) -> None:
        self.peer, self.target, self.errors = peer, target, errors

    def send(self, msg: object, timeout: float) -> int:
        if self.errors:
            raise self.errors.pop(0)
        return self.target.post(msg)

    def close(self) -> None:
        """Nothing to release."""


class Forwarder(Recorder):
    @handles(Item)
    def on_item(self, msg: Item | Ask) -> None:
        self.seen.append(msg)
        self.send("down", msg)


@pytest.mark.parametrize("error", [RingFull("ring full"), ActorDead("consumer pid 7 is gone")])
def test_a_handler_blocked_downstream_gets_its_message_again_and_nothing_is_lost(make_rig, error):
    rig = make_rig(Forwarder)
    down = Mailbox(ConditionWaiter()).add_local_inbox("x-0", PROTO)
    rig.driver.mailbox.outboxes["down"] = BlockedOutbox("down", down, [error])
    rig.post(Item(n=1), Item(n=2))
    poll_until(rig.driver, lambda: len(down._queue) == 2)
    assert drain(down) == [Item(n=1), Item(n=2)]
    assert rig.actor.seen == ["start", Item(n=1), Item(n=1), Item(n=2)]
    assert (rig.driver.deferred, rig.driver.failures, rig.actor.failed) == (1, 0, [])
    (deferred,) = rig.events("msg.deferred")
    assert pick(deferred, ("peer", "seq", "type", "error")) == {
        "peer": "host",
        "seq": 1,
        "type": "Item",
        "error": type(error).__name__,
    }


def test_a_timer_whose_handler_is_blocked_downstream_fires_again(make_rig):
    rig = make_rig(Forwarder)
    down = Mailbox(ConditionWaiter()).add_local_inbox("x-0", PROTO)
    rig.driver.mailbox.outboxes["down"] = BlockedOutbox(
        "down", down, [RingFull("full"), RingFull("full")]
    )
    rig.driver.start()
    rig.driver.schedule(0.0, Item(n=5))
    poll_until(rig.driver, lambda: bool(down._queue))
    assert drain(down) == [Item(n=5)]
    assert rig.actor.seen == ["start", Item(n=5), Item(n=5), Item(n=5)]
    assert rig.driver.deferred == 2


def test_a_peer_is_named_by_instance_or_by_an_actor_with_one_instance_never_guessed():
    from ringfence.runtime.routes import instances, one_instance

    assert instances("worker", ["worker-10", "store-0", "worker-2", "worker-x"]) == [
        "worker-2",
        "worker-10",
    ]
    assert one_instance("engine", ["engine-0", "supervisor-0"]) == "engine-0"
    assert one_instance("worker-1", ["worker-0", "worker-1"]) == "worker-1"
    assert one_instance("worker", ["worker-0", "worker-1"]) is None  # several ranks
    assert one_instance("swap", ["swap-lane-0"]) is None  # another actor's instance

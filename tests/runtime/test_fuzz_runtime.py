"""Fuzzing what every actor reads: the supervisor's control ring, the ring itself (frames a
producer wrote wrong: bad lengths, bad sequence numbers, bytes overwritten), and errors
whose text would not fit a reply; and the Client actor's inbox from the engine.

The actor under test runs on real rings (ring_rig.py). After the fuzzed frames, a real
message (the probe) must be handled as if they had not been there.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import orjson
import pytest
from fuzzing import Form, Fuzz, decode, frames, run_examples
from hypothesis import strategies as st
from ring_rig import SUPERVISOR, RingRig, ring_rig

from ringfence.actors.client.client import ClientActor, _Request
from ringfence.actors.engine.stats import no_stats
from ringfence.actors.protocol.client import (
    CLIENT_TO_ENGINE,
    ENGINE_TO_CLIENT,
    Hello,
    Stats,
    Tokens,
)
from ringfence.runtime.actor import Actor, handles
from ringfence.runtime.codec import Registry, make_kind, message
from ringfence.runtime.config import load_config
from ringfence.runtime.dispatch import ERROR_CHARS, error_text
from ringfence.runtime.mailbox import Mailbox
from ringfence.runtime.messages import RUNTIME, Failed, Stop
from ringfence.shm import names
from ringfence.shm.doorbell import Doorbell
from ringfence.shm.errors import ProtocolError
from ringfence.shm.ring import FRAME

PINGS = Registry("test-to-echo", verify=True)
PONGS = Registry("echo-to-test", verify=True)
# CI: a few dozen frames each; the soak: at least 4,000 control frames, 4,000 engine
# frames to a client, 3,000 frames in damaged rings.
FORMS = [
    pytest.param(Form(examples=10, batches=2, batch=6, frames=5), id="ci"),
    pytest.param(Form(examples=800, batches=3, batch=8, frames=4_000), id="soak",
                 marks=pytest.mark.slow),
]  # fmt: skip
DAMAGE_FORMS = [
    pytest.param(Form(examples=30, batches=1, batch=3, frames=90), id="ci"),
    pytest.param(Form(examples=1_000, batches=1, batch=3, frames=3_000), id="soak",
                 marks=pytest.mark.slow),
]  # fmt: skip


@message(PINGS, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class Ping:
    expects_reply: ClassVar[bool] = True
    n: int


@message(PONGS, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class Pong:
    n: int


class Echo(Actor):
    """Answers each Ping with a Pong of the same number."""

    @handles(Ping)
    def on_ping(self, msg: Ping) -> None:
        self.send("peer", Pong(n=msg.n))


@pytest.fixture
def echo(tmp_path: Path, run_id: str) -> Iterator[RingRig]:
    config = load_config(None, ["runtime.heartbeat_s=0.05"])
    with ring_rig(
        Echo, "echo", config=config, run_id=run_id, log_dir=tmp_path, inbox=PINGS,
        replies=PONGS, peer="peer-0",
    ) as rig:  # fmt: skip
        yield rig


def replies(rig: RingRig) -> list[object]:
    return [d.msg for d in rig.take_replies()]


def ping(rig: RingRig, n: int) -> None:
    """The probe: a Ping put now is answered, after everything put before it."""
    rig.post(Ping(n=n))
    rig.turn()


# Frames a producer wrote wrong.


def test_a_frame_that_claims_more_bytes_than_published_is_answered_skipped_and_survived(echo):
    seq = echo.post(Ping(n=1))
    FRAME.pack_into(echo.feed.ring.data, 0, 4000, make_kind(1, 1), seq)  # a bad length word
    echo.turn()
    [failed] = replies(echo)
    assert isinstance(failed, Failed) and failed.error == "ProtocolError", failed
    assert "claims 4000 bytes" in failed.message and "skipped" in failed.message
    [line] = echo.events("msg.failed")
    assert (line["peer"], line["message"], line["replied"]) == ("peer-0", failed.message, True)
    ping(echo, 2)
    assert replies(echo) == [Pong(n=2)]
    assert echo.driver.error is None


def test_a_frame_out_of_sequence_is_skipped_alone_and_the_frames_after_it_are_handled(echo):
    echo.post(Ping(n=1))
    echo.feed._next_seq = 9  # a producer that skipped numbers: 2..8 never come
    echo.post(Ping(n=2))
    echo.post(Ping(n=3))
    echo.feed._next_seq = 10  # and one that sends a number twice
    echo.post(Ping(n=4))
    echo.post(Ping(n=5))
    echo.turn()
    got = replies(echo)
    assert got[0] == Pong(n=1) and got[2] == Pong(n=3) and got[4] == Pong(n=5), got
    gap, duplicate = got[1], got[3]
    assert isinstance(gap, Failed) and "sequence gap: expected 2, got 9" in gap.message
    assert isinstance(duplicate, Failed) and "duplicate: expected 11, got 10" in duplicate.message
    assert (gap.seq, duplicate.seq) == (9, 10)


def test_a_reader_that_restarts_after_skipping_a_malformed_frame_takes_the_next_frame(echo):
    seq = echo.post(Ping(n=1))
    FRAME.pack_into(echo.feed.ring.data, 0, 1 << 30, 0, seq)
    echo.turn()
    assert isinstance(replies(echo)[0], Failed)
    reader = echo.driver.mailbox.inboxes[1].reader  # type: ignore[attr-defined]
    reader.rewind()  # what a restarted actor's reader does first: the commit says resync
    echo.feed._next_seq = 40  # its producer restarted too, say, numbering afresh
    ping(echo, 2)
    assert replies(echo) == [Pong(n=2)]


damages = st.tuples(
    st.lists(st.tuples(st.integers(0, 40), st.binary(min_size=1, max_size=16)), max_size=4),
    st.integers(0, 1000),
)


def damage_the_ring(rig: RingRig, damage: list[tuple[int, bytes]], n: int) -> int:
    """Three Pings with ``damage`` done to their bytes in the ring: each answered, refused
    with Failed, or swallowed (below); the actor lives; and the reader is back in sequence
    by the second Ping put after them. The frames put.

    Frames carry no checksum, so damage can leave the reader expecting a wrong seq without
    any frame looking malformed: a length overwritten to reach exactly past the frames after
    it makes them its payload (no reply names them), and a seq overwritten in the frame
    taken right after a refusal (taken whatever its seq) sets the next expected seq. The
    next good frame, the probe, then shows it: it is refused as a sequence gap or duplicate
    (every frame out of sequence is), and the reader takes the one after it whatever its
    seq. So the probe is answered, or refused that way and a second probe answered."""
    rig.turn()
    replies(rig)
    start = rig.feed._head % rig.feed.ring.capacity
    for k in range(3):
        rig.post(Ping(n=k))
    for offset, data in damage:
        at = start + offset
        rig.feed.ring.data[at : at + len(data)] = data
    rig.turn()
    for reply in replies(rig):
        assert isinstance(reply, Pong | Failed), reply
    probe = rig.post(Ping(n=n))
    rig.turn()
    got = replies(rig)[-1]
    if got != Pong(n=n):
        assert isinstance(got, Failed) and got.seq == probe, got
        assert re.search(f"sequence (gap|duplicate): expected \\d+, got {probe};", got.message)
        ping(rig, n)
        got = replies(rig)[-1]
    assert got == Pong(n=n)
    assert rig.driver.error is None
    return 3


@pytest.mark.parametrize("form", DAMAGE_FORMS)
def test_bytes_overwritten_in_published_frames_cost_those_frames_never_the_actor(echo, form):
    """Whatever bytes of the published frames are overwritten, every Ping is answered,
    refused with Failed or swallowed by a damaged length, the actor lives, and the second
    Ping put after that is answered (the first too, unless it is refused as out of the
    sequence the damage left)."""
    put = run_examples(form, damages, lambda d: damage_the_ring(echo, *d))
    print(f"damaged rings: {put} frames")


def test_a_frame_whose_error_would_not_fit_a_reply_is_answered_with_the_error_cut_short(echo):
    huge = "\\" * 200_000  # JSON and repr escape each backslash: the error text doubles twice
    echo.put(make_kind(1, 1), orjson.dumps({"n": 1, huge: 0}))
    echo.put(make_kind(1, 1), orjson.dumps({"n": huge}))
    echo.turn()
    extra, mistyped = replies(echo)
    assert isinstance(extra, Failed) and isinstance(mistyped, Failed)
    assert "not a field of Ping" in extra.message and len(extra.message) < 200
    assert "expected int, got str" in mistyped.message
    ping(echo, 7)
    assert replies(echo) == [Pong(n=7)]


def test_a_closed_mailbox_ignores_a_wake_its_closed_doorbell_could_not_take(run_id):
    bell = Doorbell.create(names.posix_name(run_id, "bell"), spin_us=0)
    try:
        mailbox = Mailbox(bell, resources=[bell])
        mailbox.close()
        mailbox.wake()  # a host stopping an actor that has just stopped itself
    finally:
        bell.unlink()


def test_error_text_is_cut_to_its_limit_and_says_how_long_it_was():
    assert error_text(ValueError("short")) == "short"
    cut = error_text(ValueError("x" * 10_000))
    assert len(cut) <= ERROR_CHARS and cut.endswith("(10000 characters in all)")


# The supervisor's control ring.


def fuzz_the_control_ring(rig: RingRig, batch: list[Fuzz], n: int) -> int:
    """A control frame the codec refuses is logged (no reply: the supervisor does not read
    any); a decodable Failed is logged as refused; only a real Stop stops the actor."""
    rig.driver.log.flush()
    seen = len(rig.events("msg.failed"))
    expected = []
    for fuzz in batch:
        outcome = decode(RUNTIME, fuzz.kind, fuzz.payload)
        if isinstance(outcome, Stop):
            continue  # honoured: that is what the control ring is for
        rig.control.put(fuzz.kind, fuzz.payload, 1.0)
        if isinstance(outcome, ProtocolError):
            expected.append(error_text(outcome))
        elif not isinstance(outcome, Failed):
            expected.append(f"echo-0: no handler for {type(outcome).__name__}")
    ping(rig, n)
    assert replies(rig) == [Pong(n=n)]
    lines = rig.events("msg.failed")[seen:]
    assert [line["message"] for line in lines] == expected
    assert {line["peer"] for line in lines} <= {SUPERVISOR}
    return len(batch)


@pytest.mark.parametrize("form", FORMS)
def test_fuzzed_control_frames_are_logged_naming_the_error_and_the_actor_runs_on(echo, form):
    # At most 64 control frames a batch: the driver takes that many from one inbox before
    # the next, so the Ping after them is handled after all of them.
    batches = st.lists(frames(RUNTIME), min_size=1, max_size=min(form.batch * form.batches, 64))
    put = run_examples(
        form, st.tuples(batches, st.integers(0, 1000)), lambda b: fuzz_the_control_ring(echo, *b)
    )
    print(f"control ring: {put} fuzzed frames")


# The Client actor: the engine's answers.


REQUEST_SEQ = 987_654_321  # the transport seq the real request was sent with


@pytest.fixture
def client(tmp_path: Path, run_id: str) -> Iterator[RingRig]:
    config = load_config(None, ["runtime.heartbeat_s=0.05"])
    with ring_rig(
        ClientActor, "client", config=config, run_id=run_id, log_dir=tmp_path,
        inbox=ENGINE_TO_CLIENT, replies=CLIENT_TO_ENGINE,
    ) as rig:  # fmt: skip
        [hello] = replies(rig)
        assert isinstance(hello, Hello)
        yield rig


def check_engine_answers(rig: RingRig, sent: list[tuple[int, Fuzz]], got: list[object]) -> None:
    """Each frame the codec refused was answered with Failed carrying its error; nothing else
    was answered."""
    refused = [(seq, decode(rig.registry, f.kind, f.payload)) for seq, f in sent]
    want = [(seq, error_text(e)) for seq, e in refused if isinstance(e, ProtocolError)]
    assert [(r.seq, r.message) for r in got if isinstance(r, Failed)] == want
    assert all(isinstance(r, Failed) for r in got), got


def fuzz_the_client(rig: RingRig, batches: list[list[Fuzz]]) -> int:
    """Each batch, then one real Tokens; the real request gets exactly the real tokens."""
    request = rig.actor.requests["real"] = _Request(engine=None, seq=REQUEST_SEQ)
    for k, batch in enumerate(batches):
        sent = [(rig.put(f.kind, f.payload), f) for f in batch if not is_real(rig, f)]
        rig.post(Tokens(request_id="real", incarnation=1, token_ids=(k,)))
        rig.turn()
        check_engine_answers(rig, sent, replies(rig))
        assert request.token_ids == list(range(k + 1)) and not request.done, request
    return sum(len(batch) for batch in batches)


def is_real(rig: RingRig, fuzz: Fuzz) -> bool:
    """A decodable message about the real request (as sent, or failing its frame): not
    fuzz but the engine's legitimate word on it, left out."""
    outcome = decode(rig.registry, fuzz.kind, fuzz.payload)
    if isinstance(outcome, Failed):
        return outcome.seq == REQUEST_SEQ
    return getattr(outcome, "request_id", None) == "real"


@pytest.mark.parametrize("form", FORMS)
def test_the_client_drops_fuzzed_engine_frames_and_its_request_gets_exactly_its_tokens(
    client, form
):
    batch = st.lists(frames(ENGINE_TO_CLIENT), max_size=form.batch)
    batches = st.lists(batch, min_size=1, max_size=form.batches)
    put = run_examples(form, batches, lambda b: fuzz_the_client(client, b))
    print(f"client: {put} fuzzed frames")


def test_tokens_for_an_unknown_request_or_another_incarnation_are_counted_as_dropped(client):
    client.actor.requests["real"] = _Request(engine=None, seq=REQUEST_SEQ)
    client.post(Tokens(request_id="nobody", incarnation=1, token_ids=(1,)))
    client.post(Tokens(request_id="real", incarnation=7, token_ids=(2,)))
    client.turn()
    assert client.actor.dropped == 2 and client.actor.requests["real"].token_ids == []


def test_the_client_keeps_the_newest_stats_of_its_incarnation_and_drops_another_ones(client):
    def stats(steps: int, incarnation: int) -> Stats:
        return replace(no_stats(), began=True, steps=steps, incarnation=incarnation)

    client.post(stats(1, incarnation=7))
    client.turn()
    assert (client.actor.stats, client.actor.dropped) == (None, 1)
    client.post(stats(2, incarnation=1))
    client.post(stats(3, incarnation=1))
    client.turn()
    assert client.actor.stats == stats(3, incarnation=1) and client.actor.dropped == 1

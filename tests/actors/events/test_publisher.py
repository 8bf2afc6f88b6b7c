"""The KV event publisher (actors/events/publisher.py) as a subscriber written for vLLM
uses it: a SUB socket reads [topic, seq, payload] in order, a replay request (REQ's
framing) gets every kept batch from its sequence number, then the end marker; a bad
request is answered with the end marker, a bad endpoint named."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from ringfence.actors.events.publisher import END_SEQ, EventPublisher, PublisherError

WAIT_MS = 10_000


@pytest.fixture
def publisher() -> Iterator[EventPublisher]:
    pub = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=3, topic="kv")
    yield pub
    pub.close()


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def received(sock: zmq.Socket[bytes]) -> list[bytes]:
    assert sock.poll(WAIT_MS), "nothing arrived in time"
    return sock.recv_multipart()


def test_a_subscriber_gets_every_batch_in_order_with_its_topic_and_number(publisher, ctx):
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(publisher.endpoints.publish)
    # A SUB socket joins late (ZMQ's slow joiner): publish until it hears one, then the rest
    # must all come, in order.
    first = None
    while first is None:
        publisher.publish(b"warm-up")
        if sub.poll(100):
            first = sub.recv_multipart()
    start = int.from_bytes(first[1], "big")
    for n in range(5):
        publisher.publish(b"batch %d" % n)
    frames: list[list[bytes]] = []
    while len(frames) < 5:
        got = received(sub)
        if got[2] != b"warm-up":
            frames.append(got)
    seqs = [int.from_bytes(f[1], "big") for f in frames]
    assert seqs == sorted(seqs) and seqs[0] > start and len(set(seqs)) == 5
    assert [f[0] for f in frames] == [b"kv"] * 5
    assert [f[2] for f in frames] == [b"batch %d" % n for n in range(5)]


def test_a_replay_sends_the_kept_batches_from_the_number_asked_then_the_end(publisher, ctx):
    for n in range(5):
        publisher.publish(b"batch %d" % n)
    # A DEALER with REQ's framing ([b"", seq]): it can take the many answers of one request.
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(publisher.endpoints.replay)
    dealer.send_multipart([b"", (3).to_bytes(8, "big")])
    answers = []
    while True:
        empty, seq, payload = received(dealer)
        assert empty == b""
        if seq == END_SEQ:
            assert payload == b""
            break
        answers.append((int.from_bytes(seq, "big"), payload))
    # buffer_steps=3 keeps batches 2, 3 and 4; from 3 on: 3 and 4.
    assert answers == [(3, b"batch 3"), (4, b"batch 4")]
    assert publisher.counts.replays == 1


def test_a_replay_request_of_another_shape_gets_the_end_marker_and_is_counted(publisher, ctx):
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(publisher.endpoints.replay)
    dealer.send_multipart([b"", b"short"])
    assert received(dealer) == [b"", END_SEQ, b""]
    assert publisher.counts.bad_replays == 1


def test_port_zero_binds_a_free_port_and_the_endpoints_say_which():
    pub = EventPublisher("tcp://*:0", "", buffer_steps=1)
    try:
        host, port = pub.endpoints.publish.removeprefix("tcp://").rsplit(":", 1)
        assert host == "0.0.0.0" and int(port) > 0
        assert pub.endpoints.replay == ""
    finally:
        pub.close()


def test_an_endpoint_that_cannot_be_bound_is_named():
    with pytest.raises(PublisherError, match="an events endpoint is tcp://HOST:PORT"):
        EventPublisher("http://127.0.0.1:0", "", buffer_steps=1)
    first = EventPublisher("tcp://127.0.0.1:0", "", buffer_steps=1)
    try:
        with pytest.raises(PublisherError, match="Address already in use"):
            EventPublisher(first.endpoints.publish, "", buffer_steps=1)
    finally:
        first.close()

"""``bench router-latency``'s stub instance (actors/tools/bench/serving/stub_instance.py)
served in this process, read by the bench's bare HTTP/1.1 client (serving/http1.py): an
identity the router accepts, ``/tokenize`` as UTF-8 bytes, JSON and streamed answers, and
KV events of the blocks it has not published before."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import orjson
import pytest
from fake_serve import listening_socket

from ringfence.actors.events.publisher import EventPublisher
from ringfence.actors.events.subscriber import EventFollower
from ringfence.actors.events.wire import decode_batch
from ringfence.actors.router.instances import Identity
from ringfence.actors.serve.server import HttpThread
from ringfence.actors.tools.bench.serving import stub_instance
from ringfence.actors.tools.bench.serving.http1 import Answer, Connection
from ringfence.actors.tools.bench.serving.instance_api import BLOCK_SIZE, NAMESPACE
from ringfence.actors.tools.bench.serving.stub_instance import Blocks
from ringfence.cache.block_hash import block_keys
from ringfence.cache.kv_events import BlockStored, KVEvent

STOP_S = 5.0


@pytest.fixture
def publisher() -> Iterator[EventPublisher]:
    made = EventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", buffer_steps=100)
    yield made
    made.close()


def serve(publisher: EventPublisher | None) -> tuple[str, HttpThread]:
    sock = listening_socket("127.0.0.1", 0)
    http = HttpThread(stub_instance.build_app(publisher), sock, asyncio.new_event_loop())
    http.start()
    return f"http://127.0.0.1:{sock.getsockname()[1]}", http


@pytest.fixture
def stub(publisher: EventPublisher) -> Iterator[str]:
    url, http = serve(publisher)
    yield url
    assert http.stop(STOP_S), "the stub did not stop"


def post(url: str, path: str, body: object) -> Answer:
    async def one() -> Answer:
        connection = Connection(url)
        try:
            return await connection.post(path, orjson.dumps(body))
        finally:
            connection.close()

    return asyncio.run(one())


def get_identity(url: str) -> Identity:
    import httpx

    with httpx.Client(trust_env=False) as client:
        return Identity.of(url, client.get(f"{url}/ringfence/instance").json())


def test_the_identity_is_an_aggregated_instance_that_publishes_its_events(stub, publisher):
    ident = get_identity(stub)
    ends = publisher.endpoints
    assert ident == Identity(role="both", model="stub", fingerprints=("stub",),
                             namespace=NAMESPACE.hex(), block_size=BLOCK_SIZE,
                             events=(ends.publish, ends.replay))  # fmt: skip


def test_a_stub_without_a_publisher_says_it_has_no_events():
    url, http = serve(None)
    try:
        assert get_identity(url).events is None
    finally:
        assert http.stop(STOP_S)


def get(url: str, path: str) -> Answer:
    import httpx

    with httpx.Client(trust_env=False) as client:
        answer = client.get(f"{url}{path}")
        return Answer(answer.status_code, answer.content)


def test_its_load_is_idle_number_1_at_once_then_again_once_the_poll_is_held(stub):
    idle = {"seq": 1, "pending": 0, "running": 0, "waiting": 0, "reservations": 0,
            "free_blocks": stub_instance.BLOCKS, "total_blocks": stub_instance.BLOCKS}  # fmt: skip
    first = get(stub, "/ringfence/load?after=0&wait_s=5")
    assert first.status == 200 and orjson.loads(first.body) == idle
    held = get(stub, "/ringfence/load?after=1&wait_s=0.05")
    assert held.status == 200 and orjson.loads(held.body) == idle
    assert get(stub, "/ringfence/load?after=x").status == 400


def test_tokenize_gives_the_utf8_bytes_of_a_prompt_or_of_a_chats_contents(stub):
    answer = post(stub, "/tokenize", {"prompt": "ab"})
    assert answer.status == 200 and orjson.loads(answer.body)["tokens"] == [97, 98]
    chat = {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "é"}]}
    assert orjson.loads(post(stub, "/tokenize", chat).body)["tokens"] == [97, 0xC3, 0xA9]


def test_a_completion_answers_max_tokens_tokens_as_json(stub):
    answer = post(stub, "/v1/completions", {"prompt": [1, 2], "max_tokens": 3})
    body = orjson.loads(answer.body)
    assert answer.status == 200 and body["choices"][0]["text"] == "tok0 tok1 tok2 "
    chat = post(stub, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert orjson.loads(chat.body)["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 "


def test_a_streamed_completion_is_one_event_a_token_then_done_read_through_chunks(stub):
    answer = post(stub, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True})
    events = answer.body.split(b"\n\n")
    assert answer.status == 200 and events[-2:] == [b"data: [DONE]", b""]
    texts = [orjson.loads(e.removeprefix(b"data: "))["choices"][0]["text"] for e in events[:-2]]
    assert texts == ["tok0 ", "tok1 "]
    assert answer.body == b"".join(stub_instance.events("completions", 2))


def stored(payload: bytes) -> BlockStored:
    (event,) = decode_batch(payload).events
    assert isinstance(event, BlockStored)
    return event


def test_only_blocks_not_published_before_are_published_chained_to_the_last_known():
    blocks, ids = Blocks(), list(range(1, 3 * BLOCK_SIZE + 5))
    keys = block_keys(ids, BLOCK_SIZE, namespace=NAMESPACE)
    first = stored(blocks.batch_of(ids[: 2 * BLOCK_SIZE]) or b"")
    assert first.keys == tuple(keys[:2]) and first.parent is None
    assert first.token_ids == tuple(ids[: 2 * BLOCK_SIZE])
    assert blocks.batch_of(ids[: 2 * BLOCK_SIZE + 3]) is None  # no new full block
    third = stored(blocks.batch_of(ids) or b"")
    assert third.keys == (keys[2],) and third.parent == keys[1]
    assert third.token_ids == tuple(ids[2 * BLOCK_SIZE : 3 * BLOCK_SIZE])


def test_a_completions_new_blocks_reach_a_follower_of_the_stubs_events(stub, publisher):
    got: list[KVEvent] = []
    arrived = threading.Event()

    def on_batch(events: list[KVEvent]) -> None:
        got.extend(events)
        arrived.set()

    ends = publisher.endpoints
    follower = EventFollower(ends.publish, ends.replay, on_batch=on_batch, on_reset=lambda: None)
    follower.start()
    try:
        text = "q" * (2 * BLOCK_SIZE)
        assert post(stub, "/v1/completions", {"prompt": text}).status == 200
        assert arrived.wait(10.0), "no batch reached the follower"
    finally:
        follower.close()
    keys = block_keys(list(text.encode()), BLOCK_SIZE, namespace=NAMESPACE)
    assert [e.keys for e in got if isinstance(e, BlockStored)] == [tuple(keys)]

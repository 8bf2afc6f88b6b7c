"""``ringfence router --instance --policy cache`` in this process over two simulated
instances (actors/tools/bench/serving/sim_instance.py), also in this process and publishing
no events: a prompt in flight counts as held where the router sent it, until its answer
ended."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from fake_serve import listening_socket
from launching import wait_until
from routing import Rig, routed_urls

from ringfence.actors.router.forward import INSTANCE_HEADER
from ringfence.actors.serve.server import HttpThread
from ringfence.actors.tools.bench.serving import sim_instance
from ringfence.actors.tools.bench.serving.instance_api import BLOCK_SIZE, NAMESPACE
from ringfence.actors.tools.bench.serving.sim_engine import CostModel
from ringfence.cache.block_hash import block_keys

STOP_S = 5.0
ENDED_S = 30.0  # how long the router may take to end a request whose client left


@pytest.fixture
def rig() -> Iterator[Rig]:
    servers = []
    for _ in range(2):
        sock, loop = listening_socket("127.0.0.1", 0), asyncio.new_event_loop()
        stopping = asyncio.Event()
        app = sim_instance.build_app(CostModel(step_ms=1.0), None, stopping)
        http = HttpThread(app, sock, loop)
        http.start()
        servers.append((f"http://127.0.0.1:{sock.getsockname()[1]}", http, loop, stopping))
    try:
        with routed_urls([], [], instances=tuple(s[0] for s in servers), policy="cache") as rig:
            yield rig
    finally:
        for _, http, loop, stopping in servers:
            loop.call_soon_threadsafe(stopping.set)  # the router's held load polls answer
            assert http.stop(STOP_S), "a sim did not stop"


def test_a_prompt_in_flight_draws_its_next_turn_to_its_instance_until_it_ended(rig):
    system = list(range(1, 10 * BLOCK_SIZE + 1))
    first = {"prompt": system, "max_tokens": 50_000, "stream": True}
    picker = rig.router.picker
    assert picker is not None
    keys = block_keys(system, BLOCK_SIZE, namespace=NAMESPACE)
    with rig.http() as client, client.stream("POST", "/v1/completions", json=first) as stream:
        assert stream.status_code == 200, stream.read()
        where = stream.headers[INSTANCE_HEADER]
        lines = stream.iter_lines()  # kept: the stream is read while it is referenced
        next(lines)  # its first token came: it runs there, decoding
        (holder,) = (i for i in picker.instances if i.url == where)
        assert picker.flying(holder, keys) == 10
        # Its next turn: no event told the router where the prefix is (the sims publish
        # none), and the other instance is idle; the prompt in flight draws it there.
        turn = client.post("/v1/completions", json={"prompt": [*system, 7], "max_tokens": 1})
        assert turn.status_code == 200 and turn.headers[INSTANCE_HEADER] == where
        cached = turn.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == 10 * BLOCK_SIZE
    # The client left the first stream: the router ended it, and its prompt counts no more.
    wait_until("the first request's end", lambda: picker.flying(holder, keys) == 0, ENDED_S)
    # Nothing holds the prefix for the router now: the next one goes in turn, to the other.
    (other,) = (i for i in picker.instances if i is not holder)
    with httpx.Client(base_url=rig.url, trust_env=False, timeout=30.0) as client:
        answer = client.post("/v1/completions", json={"prompt": [*system, 8], "max_tokens": 1})
    assert answer.headers[INSTANCE_HEADER] == other.url

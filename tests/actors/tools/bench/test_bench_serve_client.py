"""``ringfence bench serve``'s load generator against a tiny in-process Starlette app on
127.0.0.1 that speaks ``ringfence serve``'s framing (tests/fake_serve.py), and the SSE
parsing line by line."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import uvicorn
from fake_serve import (
    MODEL,
    SEED_BAD_REQUEST,
    SEED_NO_DONE,
    SEED_TWO_A_CHUNK,
    app,
    expected_tokens,
    listening_socket,
)

from ringfence.actors.tools.bench.serving.client import (
    LoadRequest,
    _Stream,
    read_event,
    run_load,
    served_model,
)

STOP_S = 10.0


@pytest.fixture
def base_url() -> Iterator[str]:
    """The fake app served by uvicorn on a thread, on a free port of 127.0.0.1."""
    sock = listening_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app(), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(STOP_S)
        sock.close()
        assert not thread.is_alive(), "the fake server did not stop"


def request(
    id: str, prompt: tuple[int, ...], max_tokens: int, *, arrival_s: float = 0.0, seed: int = 0
) -> LoadRequest:
    return LoadRequest(
        id=id, prompt_token_ids=prompt, max_tokens=max_tokens, arrival_s=arrival_s, seed=seed
    )


def test_every_streamed_token_is_timed_and_counted_in_order(base_url: str) -> None:
    requests = [request("a", (1, 2, 3), 5), request("b", (9,), 1), request("c", (7, 8), 4)]
    timelines, start = run_load(base_url, requests, model=MODEL, timeout=10.0)
    assert [t.id for t in timelines] == ["a", "b", "c"]
    for t, r in zip(timelines, requests, strict=True):
        assert t.error == ""
        assert list(t.token_ids) == expected_tokens(list(r.prompt_token_ids), r.max_tokens)
        assert t.chunk_tokens == (1,) * r.max_tokens
        assert start <= t.sent_s < t.chunk_s[0] <= t.chunk_s[-1] <= t.end_s
    assert timelines[1].tpot_s is None and timelines[1].itl_s == []
    assert len(timelines[0].itl_s) == 4


def test_a_chunk_of_two_tokens_is_one_gap_and_two_tokens(base_url: str) -> None:
    (t,), _ = run_load(
        base_url, [request("a", (5,), 4, seed=SEED_TWO_A_CHUNK)], model=None, timeout=10.0
    )
    assert t.chunk_tokens == (2, 2) and t.output_tokens == 4 and len(t.itl_s) == 1
    assert list(t.token_ids) == [6, 7, 8, 9]


def test_requests_leave_at_their_arrival_times(base_url: str) -> None:
    requests = [request("a", (1,), 1, arrival_s=0.0), request("b", (1,), 1, arrival_s=0.3)]
    (a, b), start = run_load(base_url, requests, model=MODEL, timeout=10.0)
    assert a.sent_s - start < 0.2
    assert b.sent_s - start >= 0.3


def test_an_error_answer_and_a_stream_without_done_fail_only_their_request(
    base_url: str,
) -> None:
    requests = [
        request("bad", (1,), 2, seed=SEED_BAD_REQUEST),
        request("cut", (1,), 2, seed=SEED_NO_DONE),
        request("good", (1,), 2),
    ]
    bad, cut, good = run_load(base_url, requests, model=MODEL, timeout=10.0)[0]
    assert bad.error.startswith("HTTP 400: ") and "bad seed" in bad.error
    assert cut.error == "the stream ended without [DONE]" and cut.output_tokens == 2
    assert good.error == "" and good.output_tokens == 2


def test_a_server_that_is_not_there_fails_each_request_by_name() -> None:
    from fake_serve import listening_socket as bind

    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    (t,), _ = run_load(f"http://127.0.0.1:{port}", [request("a", (1,), 1)], model=None, timeout=5)
    assert t.error.startswith("ConnectError")


def test_the_served_model_is_read_from_v1_models(base_url: str) -> None:
    assert served_model(base_url, timeout=5.0) == MODEL


def test_read_event_skips_comments_blank_lines_and_the_usage_chunk() -> None:
    stream = _Stream()
    lines = [
        ": keep-alive",
        "",
        "event: message",
        'data: {"choices": [{"index": 0, "token_ids": [4, 5]}]}',
        'data: {"choices": [{"index": 0, "token_ids": []}]}',
        'data: {"choices": [], "usage": {"completion_tokens": 2}}',
        "data: [DONE]",
    ]
    for now, line in enumerate(lines):
        read_event(line, float(now), stream)
    assert stream.chunk_s == [3.0] and stream.chunk_tokens == [2] and stream.token_ids == [4, 5]
    assert stream.usage == {"completion_tokens": 2} and stream.done


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("data: {not json", "not JSON"),
        ('data: {"object": "text_completion"}', "without choices"),
        ('data: {"choices": [{"token_ids": ["a"]}]}', "list of ints"),
    ],
)
def test_read_event_refuses_a_chunk_it_cannot_read(line: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_event(line, 0.0, _Stream())


def test_read_event_refuses_data_after_done() -> None:
    stream = _Stream()
    read_event("data: [DONE]", 0.0, stream)
    with pytest.raises(ValueError, match=r"after \[DONE\]"):
        read_event('data: {"choices": []}', 1.0, stream)

"""`ringfence serve` answers bad requests with a 400 naming the field, and only them.

One server for the module (the tiny preset: 259 token ids; a 256-token context). Every
row of :data:`BAD` is a real HTTP request that must be answered 400 with OpenAI's error
body, whose ``param`` names the field at fault and whose message says what was wrong; sent
all at once among good requests, the good ones still get the tokens they get alone.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from serving import Server

MAX_MODEL_LEN = 256  # the shared server's (conftest.py)
VOCAB = 259  # the tiny preset's: 256 bytes and three specials
COMPLETION = {"prompt": [10, 20, 30, 40, 50], "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
ENDPOINTS = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}
GOOD = [[11 + i, 22, 33 + 2 * i, 44, 55 + i] for i in range(4)]

# Fields both endpoints share: (what the request adds, param, what the message says).
SHARED: list[tuple[str, dict[str, Any], str, str]] = [
    ("max_tokens a string", {"max_tokens": "x"}, "max_tokens", "valid integer"),
    ("max_tokens a float", {"max_tokens": 4.5}, "max_tokens", "valid integer"),
    ("temperature a word", {"temperature": "hot"}, "temperature", "valid number"),
    ("stream a number", {"stream": 3}, "stream", "valid boolean"),
    ("ignore_eos a number", {"ignore_eos": 0}, "ignore_eos", "valid boolean"),
    ("unknown model", {"model": "gpt-4"}, "model", "'gpt-4' is not served here"),
    ("max_tokens -1", {"max_tokens": -1}, "max_tokens", "greater than or equal to"),
    ("max_tokens past the room", {"max_tokens": MAX_MODEL_LEN}, "max_tokens",
     f"maximum context length of {MAX_MODEL_LEN}"),
    ("n 0", {"n": 0}, "n", "greater than or equal to 1"),
    ("n 129", {"n": 129}, "n", "less than or equal to 128"),
    ("prompt_logprobs 21", {"prompt_logprobs": 21}, "prompt_logprobs", "less than or equal to 20"),
    ("top_p 0", {"top_p": 0}, "top_p", "greater than 0"),
    ("top_p 1.5", {"top_p": 1.5}, "top_p", "less than or equal to 1"),
    ("temperature -1", {"temperature": -1}, "temperature", "greater than or equal to 0"),
    ("17 stop strings", {"stop": [f"s{i}" for i in range(17)]}, "stop",
     "at most 16 strings, got 17"),
    ("stop id past the vocabulary", {"stop_token_ids": [VOCAB]}, "stop_token_ids",
     f"token id {VOCAB} is outside the vocabulary (0..{VOCAB - 1})"),
    ("stop id past 64 bits", {"stop_token_ids": [1 << 70]}, "stop_token_ids",
     "outside the vocabulary"),
    ("negative stop id", {"stop_token_ids": [-1]}, "stop_token_ids.0",
     "greater than or equal to 0"),
    ("presence_penalty 3", {"presence_penalty": 3}, "presence_penalty",
     "less than or equal to 2"),
    ("frequency_penalty -2.5", {"frequency_penalty": -2.5}, "frequency_penalty",
     "greater than or equal to -2"),
    ("repetition_penalty 0", {"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ("top_k -2", {"top_k": -2}, "top_k", "greater than or equal to -1"),
    ("min_p 2", {"min_p": 2}, "min_p", "less than or equal to 1"),
    ("min_tokens past max_tokens", {"min_tokens": 5}, "min_tokens",
     "must be <= max_tokens (4), got 5"),
    ("logit_bias key past the vocabulary", {"logit_bias": {str(VOCAB): 1}}, "logit_bias",
     f"key {VOCAB} is outside the vocabulary (size {VOCAB})"),
    ("logit_bias key not an id", {"logit_bias": {"a": 1}}, "logit_bias",
     "key 'a' is not a non-negative token id"),
    ("logit_bias value a string", {"logit_bias": {"5": "x"}}, "logit_bias.5", "valid number"),
]  # fmt: skip

# Requests of one endpoint: (path, body: JSON or raw bytes, param, what the message says).
ONLY: list[tuple[str, str, Any, str | None, str]] = [
    ("malformed JSON", "/v1/completions", b'{"prompt": ', None, "not valid JSON"),
    ("malformed chat JSON", "/v1/chat/completions", b"{'messages': []}", None, "not valid JSON"),
    ("a body not UTF-8", "/v1/completions", b'{"prompt": "\xff"}', None, "error parsing the body"),
    ("an array body", "/v1/completions", [COMPLETION], None, "must be a JSON object, got an array"),
    ("a string body", "/v1/chat/completions", "hi", None, "must be a JSON object, got a string"),
    ("no prompt", "/v1/completions", {"max_tokens": 4}, "prompt", "Field required"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, "prompt", "the prompt is empty"),
    ("empty id list", "/v1/completions", {"prompt": []}, "prompt", "the prompt is empty"),
    ("prompt past max_model_len", "/v1/completions", {"prompt": [7] * MAX_MODEL_LEN}, "prompt",
     f"the prompt has {MAX_MODEL_LEN} tokens; this model's maximum context length is "
     f"{MAX_MODEL_LEN}"),
    ("id past the vocabulary", "/v1/completions", {"prompt": [1, VOCAB]}, "prompt",
     f"token id {VOCAB} is outside the vocabulary (0..{VOCAB - 1})"),
    ("negative id", "/v1/completions", {"prompt": [1, -1]}, "prompt.1",
     "greater than or equal to 0"),
    ("false as an id", "/v1/completions", {"prompt": [[False]]}, "prompt.0.0", "valid integer"),
    ("prompt a number", "/v1/completions", {"prompt": 5}, "prompt", "valid string"),
    ("two prompts", "/v1/completions", {"prompt": ["a", "b"]}, "prompt",
     "one prompt per request is supported, got a list of 2"),
    ("lone surrogate", "/v1/completions", b'{"prompt": "a\\ud800"}', "prompt",
     "not a Unicode character"),
    ("best_of 2", "/v1/completions", {**COMPLETION, "best_of": 2}, "best_of",
     "only best_of = n (1) is supported, got 2"),
    ("best_of under n", "/v1/completions", {**COMPLETION, "n": 3, "best_of": 2}, "best_of",
     "only best_of = n (3) is supported, got 2"),
    ("max_tokens 0 without echo", "/v1/completions", {**COMPLETION, "max_tokens": 0},
     "max_tokens", "0 is only allowed with echo"),
    ("logprobs 21", "/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs",
     "less than or equal to 20"),
    ("logprobs true", "/v1/completions", {**COMPLETION, "logprobs": True}, "logprobs",
     "valid integer"),
    ("messages a string", "/v1/chat/completions", {"messages": "hi"}, "messages", "valid list"),
    ("no messages", "/v1/chat/completions", {"messages": []}, "messages", "at least 1 item"),
    ("a message without role", "/v1/chat/completions", {"messages": [{"content": "hi"}]},
     "messages.0.role", "Field required"),
    ("chat lone surrogate", "/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages",
     "not a Unicode character"),
    ("response_format xml", "/v1/chat/completions",
     {**CHAT, "response_format": {"type": "xml"}}, "response_format.type", "'json_schema'"),
    ("chat max_tokens 0", "/v1/chat/completions", {**CHAT, "max_tokens": 0}, "max_tokens",
     "greater than or equal to 1"),
    ("top_logprobs 21", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21},
     "top_logprobs", "less than or equal to 20"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {**CHAT, "top_logprobs": 2},
     "top_logprobs", "needs logprobs: true"),
    ("chat logprobs a number", "/v1/chat/completions", {**CHAT, "logprobs": 3}, "logprobs",
     "valid boolean"),
    ("tool without function", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]},
     "tools.0.function", "Field required"),
]  # fmt: skip

# (name, path, body, param, what the message says): every bad request of the module.
ROWS: list[tuple[str, str, Any, str | None, str]] = [
    (f"{path.removeprefix('/v1/')}: {name}", path, {**base, **extra}, param, says)
    for path, base in ENDPOINTS.items()
    for name, extra, param, says in SHARED
] + ONLY
BAD = [pytest.param(*row[1:], id=row[0]) for row in ROWS]


@pytest.fixture(scope="module")
def server(tiny_server: Server) -> Server:
    return tiny_server


def send(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"Content-Type": "application/json"})
    return client.post(path, json=body)


def check_refused(answer: httpx.Response, param: str | None, says: str) -> None:
    """A 400 with OpenAI's error body, naming ``param`` and saying ``says``."""
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert says in error["message"], error
    if param is not None:
        assert error["message"].startswith(f"{param}: "), error


def greedy(client: httpx.Client, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "return_token_ids": True}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["choices"][0]["token_ids"])


def rejected_400(server: Server) -> float:
    metrics = server.get("/metrics").text
    found = re.search(r'^ringfence_requests_rejected_total\{status="400"\} (\S+)$', metrics, re.M)
    return float(found[1]) if found else 0.0


@pytest.mark.parametrize(("path", "body", "param", "says"), BAD)
def test_a_bad_request_is_a_400_naming_the_field_and_what_was_wrong(
    server, path, body, param, says
):
    with server.http() as client:
        check_refused(send(client, path, body), param, says)


def test_bad_requests_among_good_ones_leave_the_good_answers_alone(server):
    with server.http() as client:
        alone = [greedy(client, p) for p in GOOD]
        rows = ROWS[::2] + ROWS[1::2]  # the order sent: half before the good ones, half after
        with ThreadPoolExecutor(max_workers=8) as pool:
            half = len(ROWS[::2])
            bad = [pool.submit(send, client, row[1], row[2]) for row in rows[:half]]
            good = [pool.submit(greedy, client, GOOD[i % 4]) for i in range(8)]
            bad += [pool.submit(send, client, row[1], row[2]) for row in rows[half:]]
            answers = [f.result() for f in bad]
            together = [f.result() for f in good]
        for answer, (_, _, _, param, says) in zip(answers, rows, strict=True):
            check_refused(answer, param, says)
        assert together == [alone[i % 4] for i in range(8)]
        assert [greedy(client, p) for p in GOOD] == alone
        chat = client.post("/v1/chat/completions", json=CHAT)
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["finish_reason"] == "length"
        assert client.get("/health").json() == {"status": "ok"}
    assert "ringfence_requests_pending 0.0" in server.get("/metrics").text


def test_each_400_is_counted_once_in_the_metrics(server):
    before = rejected_400(server)
    with server.http() as client:
        check_refused(send(client, "/v1/completions", {"prompt": ""}), "prompt", "empty")
        check_refused(send(client, "/v1/completions", b"{"), None, "not valid JSON")
    assert rejected_400(server) == before + 2


def test_an_unknown_route_is_a_404_in_openai_error_body(server):
    answer = server.post("/v1/embeddings", {"input": "hi"})
    assert answer.status_code == 404
    assert answer.json()["error"] == {
        "message": "Not Found", "type": "invalid_request_error", "param": None, "code": None,
    }  # fmt: skip

"""`ringfence serve` answers logprobs, echo and n as vLLM does, with the model's own numbers.

One server for the module: the tiny preset in float64 (the byte tokenizer), so that every
log probability it answers equals, to 1e-9, ``log_softmax`` of the logits this test
computes with the same model (test_sampling_runs.py checks the engine's alone). Greedy
requests, so each answer's tokens are the ones the reference runs through the model.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
import torch
from serving import Server, served

from ringfence.actors.config import Config
from ringfence.actors.model.loader import load_model
from ringfence.actors.serve.logprobs import TokenNames
from ringfence.actors.text.tokenizer import ByteTokenizer

MODEL = ("model.preset=tiny", "model.dtype=float64")
PROMPT = [72, 105, 32, 226, 130, 172, 33, 10]  # "Hi €!\n": a three-byte character among them
CHAT = [{"role": "user", "content": "hi"}]
NAMES = TokenNames(ByteTokenizer())


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with served(tmp_path_factory.mktemp("logprobs"), *MODEL, "sched.max_model_len=256") as s:
        yield s


@pytest.fixture(scope="module")
def model() -> Any:
    loaded, _ = load_model(Config.load(None, list(MODEL)).model)
    return loaded


def log_softmax(model: Any, tokens: list[int]) -> torch.Tensor:
    """Row q: the log probabilities of the token after tokens[: q + 1]."""
    with torch.inference_mode():
        logits = model.forward_contiguous(torch.tensor(tokens)).to(torch.float64)
    return torch.log_softmax(logits, dim=-1)


def best(row: torch.Tensor, k: int) -> list[int]:
    return torch.argsort(row, descending=True, stable=True)[:k].tolist()


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, abs_tol=1e-9)


def check_legacy(logprobs: dict[str, Any], tokens: list[int], rows: torch.Tensor, k: int) -> None:
    """Each entry of the legacy object is the token's row of the reference."""
    assert logprobs["tokens"] == [NAMES.text(t) for t in tokens]
    for i, token in enumerate(tokens):
        row = rows[i]
        assert close(logprobs["token_logprobs"][i], float(row[token])), i
        expected = {NAMES.text(t): float(row[t]) for t in [token, *best(row, k)]}
        top = logprobs["top_logprobs"][i]
        assert top.keys() == expected.keys(), i
        assert all(close(top[name], value) for name, value in expected.items()), i


def sse(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with server.http() as http:
        answer = http.post(path, json={**body, "stream": True})
    assert answer.status_code == 200, answer.text
    events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [orjson.loads(event) for event in events[:-1]]


def test_completion_logprobs_are_the_models_log_softmax_whole_and_streamed(server, model):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 3,
            "return_token_ids": True}  # fmt: skip
    whole = server.post("/v1/completions", body).json()["choices"][0]
    out = whole["token_ids"]
    rows = log_softmax(model, PROMPT + out)[len(PROMPT) - 1 :]
    check_legacy(whole["logprobs"], out, rows, 3)
    lengths = [len(t) for t in whole["logprobs"]["tokens"]]
    assert whole["logprobs"]["text_offset"] == [sum(lengths[:i]) for i in range(len(out))]
    chunks = [c["choices"][0] for c in sse(server, "/v1/completions", body)]
    streamed = {key: [v for c in chunks for v in c["logprobs"][key]] for key in whole["logprobs"]}
    assert streamed == whole["logprobs"]
    assert [t for c in chunks for t in c["token_ids"]] == out


def test_chat_logprobs_and_top_logprobs_are_the_models_whole_and_streamed(server, model):
    body = {"messages": CHAT, "max_tokens": 5, "temperature": 0, "logprobs": True,
            "top_logprobs": 2, "return_token_ids": True}  # fmt: skip
    plain = {key: v for key, v in body.items() if key != "return_token_ids"}
    chat = server.client().chat.completions.create(
        model=None, **plain, extra_body={"return_token_ids": True}
    )
    prompt = chat.model_extra["prompt_token_ids"]
    out = chat.choices[0].model_extra["token_ids"]
    rows = log_softmax(model, prompt + out)[len(prompt) - 1 :]
    content = chat.choices[0].logprobs.content
    assert len(content) == len(out) == 5
    for i, (entry, token) in enumerate(zip(content, out, strict=True)):
        assert entry.token == NAMES.text(token) and entry.bytes == list(NAMES.raw(token))
        assert close(entry.logprob, float(rows[i][token])), i
        assert [e.token for e in entry.top_logprobs] == [NAMES.text(t) for t in best(rows[i], 2)]
        assert all(close(e.logprob, float(rows[i][t])) for e, t in
                   zip(entry.top_logprobs, best(rows[i], 2), strict=True))  # fmt: skip
    chunks = sse(server, "/v1/chat/completions", body)
    streamed = [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]]
    assert streamed == [e.model_dump() for e in content]
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role's chunk has no tokens


def test_echo_puts_the_prompt_and_its_logprobs_first_the_first_token_without(server, model):
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "logprobs": 1, "echo": True,
            "return_token_ids": True}  # fmt: skip
    choice = server.post("/v1/completions", body).json()["choices"][0]
    out = choice["token_ids"]
    logprobs = choice["logprobs"]
    assert choice["text"] == ByteTokenizer().decode(PROMPT + out)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["tokens"][0] == "H"
    tokens = PROMPT + out
    rows = log_softmax(model, tokens)
    check_legacy({key: v[1:] for key, v in logprobs.items()}, tokens[1:], rows, 1)
    lengths = [len(t) for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(tokens))]
    assert "bytes:\\xe2" in logprobs["tokens"]  # the first byte of "€"
    streamed = [c["choices"][0] for c in sse(server, "/v1/completions", body)]
    assert "".join(c["text"] for c in streamed) == choice["text"]
    assert [v for c in streamed for v in c["logprobs"]["token_logprobs"]] == logprobs[
        "token_logprobs"
    ]


def test_max_tokens_0_with_echo_scores_the_prompt_alone_as_lm_eval_asks(server, model):
    body = {"prompt": PROMPT, "max_tokens": 0, "logprobs": 1, "echo": True, "temperature": 0}
    answer = server.post("/v1/completions", body).json()
    choice = answer["choices"][0]
    assert choice["text"] == ByteTokenizer().decode(PROMPT)
    assert answer["usage"]["completion_tokens"] == 0
    assert answer["usage"]["prompt_tokens"] == len(PROMPT)
    rows = log_softmax(model, PROMPT)
    values = choice["logprobs"]["token_logprobs"]
    assert len(values) == len(PROMPT) and values[0] is None
    assert all(close(values[q], float(rows[q - 1][PROMPT[q]])) for q in range(1, len(PROMPT)))


def test_prompt_logprobs_are_vllms_field_on_both_endpoints(server, model):
    rows = log_softmax(model, PROMPT)
    cmpl = server.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                           "prompt_logprobs": 2}).json()  # fmt: skip
    for got in (cmpl["choices"][0]["prompt_logprobs"],):
        assert got[0] is None and len(got) == len(PROMPT)
        for q in range(1, len(PROMPT)):
            entry = got[q][str(PROMPT[q])]
            assert close(entry["logprob"], float(rows[q - 1][PROMPT[q]]))
            assert entry["rank"] == 1 + int((rows[q - 1] > rows[q - 1][PROMPT[q]]).sum())
            assert entry["decoded_token"] == NAMES.text(PROMPT[q])
            assert set(got[q]) == {str(t) for t in [PROMPT[q], *best(rows[q - 1], 2)]}
    chat = server.post("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                "prompt_logprobs": 0,
                                                "return_token_ids": True}).json()  # fmt: skip
    ids = chat["prompt_token_ids"]
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == len(ids)
    assert [list(row) for row in chat["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]


def test_n_seeded_choices_differ_and_repeat_and_usage_sums_them(server):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3,
            "best_of": 3}  # fmt: skip
    first, again = (server.post("/v1/completions", body).json() for _ in range(2))
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) > 1
    assert first["usage"]["completion_tokens"] == 24
    assert first["usage"]["prompt_tokens"] == len(PROMPT)
    one = server.post("/v1/completions", {**body, "n": 1, "best_of": None}).json()
    assert one["choices"][0]["text"] == texts[0]  # choice 0 keeps the request's seed
    chunks = sse(server, "/v1/completions", body)
    streamed = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i)
                for i in range(3)]  # fmt: skip
    assert streamed == texts
    chat = server.client().chat.completions.create(
        model=None,
        messages=CHAT,
        max_tokens=4,
        temperature=1.0,
        seed=7,
        n=2,  # type: ignore[arg-type]
    )
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8


def test_each_streamed_choice_echoes_the_prompt_with_its_logprobs_once(server):
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "n": 2, "echo": True,
            "logprobs": 0}  # fmt: skip
    whole = server.post("/v1/completions", body).json()["choices"]
    chunks = [c["choices"][0] for c in sse(server, "/v1/completions", body)]
    for index in range(2):
        mine = [c for c in chunks if c["index"] == index]
        assert mine[0]["text"].startswith(ByteTokenizer().decode(PROMPT))
        values = [v for c in mine for v in c["logprobs"]["token_logprobs"]]
        assert len(values) == len(PROMPT) + 3 and values[0] is None and None not in values[1:]
        # The two prefills may batch differently (chunks, the other choice's cache hit):
        # float64 sums in another order, so equal to 1e-9, not bit for bit.
        theirs = whole[index]["logprobs"]["token_logprobs"]
        assert theirs[0] is None
        assert all(
            math.isclose(a, b, abs_tol=1e-9) for a, b in zip(values[1:], theirs[1:], strict=True)
        )


def stop_inside(text: str) -> str:
    """A character of ``text`` first found past its start, and whole (not U+FFFD, which
    stands for bytes of no character: the tiny model's output has many): a stop string."""
    for k in range(1, len(text)):
        if text[k] != "\ufffd" and text.find(text[k]) == k:
            return text[k]
    raise AssertionError(f"no stop string to cut {text!r} with")


def test_a_stop_strings_tokens_are_cut_from_the_logprobs_as_from_the_text(server):
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 2,
            "return_token_ids": True}  # fmt: skip
    free = server.post("/v1/completions", body).json()["choices"][0]
    stop = stop_inside(free["text"])
    cut = {**body, "stop": [stop]}
    whole = server.post("/v1/completions", cut).json()["choices"][0]
    text = free["text"][: free["text"].find(stop)]
    assert whole["text"] == text and whole["finish_reason"] == "stop"
    kept = len(whole["logprobs"]["token_logprobs"])
    assert ByteTokenizer().decode(free["token_ids"][:kept]) == text  # not one token more
    assert whole["logprobs"]["token_logprobs"] == free["logprobs"]["token_logprobs"][:kept]
    chunks = [c["choices"][0] for c in sse(server, "/v1/completions", cut)]
    streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert (
        "".join(c["text"] for c in chunks) == text
        and streamed == whole["logprobs"]["token_logprobs"]
    )
    chat = {"messages": CHAT, "max_tokens": 16, "temperature": 0, "logprobs": True}
    said = server.post("/v1/chat/completions", chat).json()["choices"][0]
    stop = stop_inside(said["message"]["content"])
    cut_chat = server.post("/v1/chat/completions", {**chat, "stop": stop}).json()["choices"][0]
    content = cut_chat["message"]["content"]
    assert content == said["message"]["content"][: said["message"]["content"].find(stop)]
    tokens = cut_chat["logprobs"]["content"]
    assert bytes(b for t in tokens for b in t["bytes"]).decode(errors="replace") == content


def prompt_tokens_counted(server: Server) -> float:
    with server.http() as http:
        text = http.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("ringfence_prompt_tokens_total "))
    return float(line.split()[1])


def test_the_prompt_tokens_counter_counts_a_request_of_two_choices_once(server):
    before = prompt_tokens_counted(server)
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 1.0, "seed": 5, "n": 2}
    answer = server.post("/v1/completions", body).json()
    assert answer["usage"]["prompt_tokens"] == len(PROMPT) and len(answer["choices"]) == 2
    assert prompt_tokens_counted(server) - before == len(PROMPT)

"""`ringfence serve` takes vLLM's sampling knobs and tokenizer routes, and ignores, out
loud, the fields it does not know.

The shared tiny server (conftest.py: the byte tokenizer, 259 ids, a 256-token context),
driven with the ``openai`` SDK as clients drive vLLM (its extensions in ``extra_body``).
What each knob does to the output is the Worker's sampler's to test; here, that each is
accepted, and that a value out of range is a 400 naming it (test_serve_errors.py has those
rows, one per endpoint).
"""

from __future__ import annotations

from typing import Any

import openai
import pytest
from serving import Server

from ringfence.actors.serve.prompts import PRESET_TEMPLATE

PROMPT = [10, 20, 30, 40, 50]
CHAT = [{"role": "user", "content": "hi"}]
KNOBS: list[tuple[str, Any]] = [
    ("presence_penalty", 1.5),
    ("frequency_penalty", -1.0),
    ("repetition_penalty", 1.3),
    ("top_k", 5),
    ("top_k", -1),
    ("min_p", 0.1),
    ("min_tokens", 2),
    ("ignore_eos", True),
    ("logit_bias", {"65": 100, "66": -100.5}),
    ("stop", None),
]


@pytest.fixture(scope="module")
def server(tiny_server: Server) -> Server:
    return tiny_server


@pytest.mark.parametrize(("name", "value"), KNOBS, ids=[f"{n}={v}" for n, v in KNOBS])
def test_each_vllm_knob_is_accepted_by_both_endpoints(server, name, value):
    client = server.client()
    cmpl = client.completions.create(
        model=None, prompt=PROMPT, max_tokens=3, temperature=0.5, seed=1,
        extra_body={name: value},
    )  # fmt: skip
    assert cmpl.choices[0].finish_reason == "length"
    assert cmpl.usage.completion_tokens == 3
    chat = client.chat.completions.create(
        model=None, messages=CHAT, max_tokens=3, seed=1, extra_body={name: value}
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.completion_tokens == 3


def test_a_bad_knob_is_a_400_the_sdk_reports_with_its_param(server):
    client = server.client()
    bad = [
        ("presence_penalty", 3, "presence_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("top_k", -2, "top_k"),
        ("min_tokens", 4, "min_tokens"),
        ("logit_bias", {"259": 1}, "logit_bias"),
        ("logit_bias", {"5": "x"}, "logit_bias.5"),
    ]
    for name, value, param in bad:
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(
                model=None, prompt=PROMPT, max_tokens=3, extra_body={name: value}
            )
        assert refused.value.status_code == 400
        assert refused.value.param == param, (name, value, refused.value.body)


def test_unknown_fields_are_ignored_named_in_a_header_and_logged_once(server):
    body = {
        "prompt": PROMPT,
        "max_tokens": 2,
        "frobnicate": 1,
        "guided_decoding_backend": "outlines",
    }
    with server.http() as http:
        answer = http.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.headers["X-Ringfence-Ignored-Fields"] == "frobnicate, guided_decoding_backend"
        assert answer.json()["usage"]["completion_tokens"] == 2
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True, "zz": 0}}
        with http.stream("POST", "/v1/completions", json=streamed) as events:
            assert events.status_code == 200
            assert events.headers["X-Ringfence-Ignored-Fields"] == (
                "frobnicate, guided_decoding_backend, stream_options.zz"
            )
            assert list(events.iter_lines())[-2:] == ["data: [DONE]", ""]
        known = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        assert "X-Ringfence-Ignored-Fields" not in known.headers
        # A request the schema admits but the server refuses names them too (one the schema
        # refuses was never read into fields).
        refused = http.post("/v1/completions", json={**body, "min_tokens": 3})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "min_tokens"
        assert (
            refused.headers["X-Ringfence-Ignored-Fields"] == "frobnicate, guided_decoding_backend"
        )
    lines = server.frontend_events("server.fields_ignored", path="/v1/completions")
    assert [line["fields"] for line in lines][-3:] == [
        ["frobnicate", "guided_decoding_backend"],
        ["frobnicate", "guided_decoding_backend", "stream_options.zz"],
        ["frobnicate", "guided_decoding_backend"],
    ]


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server):
    client = server.client()
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model=None, prompt=PROMPT, max_tokens=4, stream=True, stream_options=options,
            extra_body={"return_token_ids": True},
        )
    )  # fmt: skip
    *deltas, last = chunks
    assert all(c.usage is not None and c.usage.prompt_tokens == 5 for c in chunks)
    counted = 0
    for chunk in deltas:
        counted += len(chunk.choices[0].model_extra["token_ids"])
        assert chunk.usage.completion_tokens == counted
    assert counted == 4
    assert last.choices == [] and last.usage.completion_tokens == 4
    chat = list(
        client.chat.completions.create(
            model=None, messages=CHAT, max_tokens=3, stream=True, stream_options=options
        )
    )
    assert chat[0].usage.completion_tokens == 0  # the opening chunk: the role only
    assert [c.usage.completion_tokens for c in chat][-1] == 3
    counts = [c.usage.completion_tokens for c in chat]
    assert counts == sorted(counts)


def test_tokenize_then_detokenize_round_trips_a_text(server):
    text = "héllo, wörld"
    with server.http() as http:
        tokens = http.post("/tokenize", json={"prompt": text}).json()
        assert tokens == {
            "count": len(text.encode()), "max_model_len": 256, "tokens": list(text.encode()),
        }  # fmt: skip
        back = http.post("/detokenize", json={"tokens": tokens["tokens"]})
        assert back.json() == {"prompt": text}
        with_bos = http.post("/tokenize", json={"prompt": "a", "add_special_tokens": True})
        assert with_bos.json()["tokens"] == [256, 97]
        chat = http.post("/tokenize", json={"messages": CHAT}).json()
        assert chat["tokens"] == list(b"<|user|>\nhi\n<|assistant|>\n")
        bare = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False})
        assert bare.json()["tokens"] == list(b"<|user|>\nhi\n")
        past = http.post("/detokenize", json={"tokens": [1, 259]})
        assert past.status_code == 400
        assert past.json()["error"]["param"] == "tokens"
        neither = http.post("/tokenize", json={})
        assert neither.status_code == 400 and neither.json()["error"]["param"] == "prompt"


def test_tokenizer_info_describes_the_byte_tokenizer(server):
    assert server.get("/tokenizer_info").json() == {
        "tokenizer_class": "ByteTokenizer",
        "vocab_size": 259,
        "model_max_length": 256,
        "bos_token": None,
        "eos_token": None,
        "pad_token": None,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "chat_template": PRESET_TEMPLATE,
    }

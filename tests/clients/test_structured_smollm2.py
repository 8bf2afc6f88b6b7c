"""Structured outputs from the real model (issue 38): SmolLM2-135M-Instruct served by
``ringfence serve`` (tests/clients/conftest.py), its grammars compiled against the GGUF
file's own tokenizer of 49,152 tokens, whose tokens span many bytes (a key and its quote
may be one token), through the openai SDK.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field
from serving import Server
from structured_workloads import CHOICES, REGEX, SCHEMA

pytest.importorskip("openai", reason="the client under test (the test extra installs openai)")

MAX_TOKENS = 64


class City(BaseModel):
    name: Annotated[str, Field(max_length=24)]
    country: Literal["France", "Germany", "Italy", "Spain"]
    population_millions: Annotated[int, Field(ge=0, le=40)]


def test_the_parse_helper_returns_a_city_for_each_of_four_sampled_choices(
    smollm2_server: Server,
) -> None:
    client = smollm2_server.client(timeout=240)
    answer = client.chat.completions.parse(
        model=None,  # type: ignore[arg-type]  # the served one
        messages=[{"role": "user", "content": "Name a large city in Europe, as JSON."}],
        response_format=City,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=5,
        n=4,
    )
    for choice in answer.choices:
        print(f"served: {choice.message.content!r}")
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, City), choice.message.content


def test_a_schema_a_regex_and_a_choice_hold_on_the_real_tokenizer_streamed_or_not(
    smollm2_server: Server,
) -> None:
    client = smollm2_server.client(timeout=240)
    asks = {
        "json": {"json": SCHEMA},
        "regex": {"regex": REGEX},
        "choice": {"choice": CHOICES},
    }
    for kind, structured in asks.items():
        for stream in (False, True):
            body: dict[str, Any] = {
                "model": None, "prompt": "Answer:", "max_tokens": MAX_TOKENS + 32,
                "temperature": 1.0, "seed": 11, "extra_body": {"structured_outputs": structured},
            }  # fmt: skip
            if stream:
                chunks = list(client.completions.create(**body, stream=True))  # type: ignore[call-overload]
                text = "".join(c.choices[0].text for c in chunks if c.choices)
                reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
            else:
                done = client.completions.create(**body)  # type: ignore[call-overload]
                text, reason = done.choices[0].text, done.choices[0].finish_reason
            print(f"{kind} stream={stream}: {text!r}")
            assert reason == "stop", (kind, text)
            if kind == "json":
                jsonschema.validate(json.loads(text), SCHEMA)
            elif kind == "regex":
                assert re.fullmatch(REGEX, text), text
            else:
                assert text in CHOICES

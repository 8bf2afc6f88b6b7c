"""Structured outputs through ``ringfence serve`` (issue 38): OpenAI's ``response_format``,
vLLM's ``structured_outputs`` and its older ``guided_*`` fields, on both endpoints, for n
choices and streamed; a spec that does not compile is a 400 naming the field with the
backend's complaint.

The shared tiny server (conftest.py: the byte tokenizer, random weights): the model writes
whatever it draws, so every valid output here is the grammar's doing.
"""

from __future__ import annotations

import json
import re
import selectors
import socket
import uuid
from typing import Annotated, Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field
from serving import Server
from structured_workloads import CHOICES, REGEX, SCHEMA

PROMPT = [10, 20, 30, 40, 50]
CHAT = [{"role": "user", "content": "a record, please"}]
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def server(tiny_server: Server) -> Server:
    return tiny_server


class Inner(BaseModel):
    ok: bool
    xs: list[Annotated[int, Field(ge=0, le=99)]] = Field(max_length=3)


class Record(BaseModel):
    id: int = Field(ge=0, le=999)
    tag: Literal["alpha", "beta", "gamma"]
    inner: Inner


def completion(server: Server, n: int = 1, **body: Any) -> list[str]:
    """The texts of ``n`` sampled choices (each ended by its grammar: finish_reason stop)."""
    answer = server.client().completions.create(  # type: ignore[call-overload]
        model=None, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=7, n=n,
        extra_body=body,
    )  # fmt: skip
    assert [c.finish_reason for c in answer.choices] == ["stop"] * n
    return [c.text for c in answer.choices]


def test_a_regex_a_choice_and_a_schema_hold_for_each_of_four_choices(server):
    for text in completion(server, n=4, structured_outputs={"regex": REGEX}):
        assert re.fullmatch(REGEX, text), text
    for text in completion(server, n=4, structured_outputs={"choice": CHOICES}):
        assert text in CHOICES
    texts = completion(server, n=4, structured_outputs={"json": SCHEMA})
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 1, "the four choices were drawn alike: one seed for all?"


def test_vllms_older_guided_fields_and_json_object_are_taken(server):
    [text] = completion(server, guided_regex="[0-9]{3}")
    assert re.fullmatch("[0-9]{3}", text)
    [text] = completion(server, guided_choice=["left", "right"])
    assert text in ("left", "right")
    [text] = completion(server, guided_json=json.dumps(SCHEMA))
    jsonschema.validate(json.loads(text), SCHEMA)
    [text] = completion(server, guided_grammar='start: "a"+ "b"')
    assert re.fullmatch("a+b", text)
    # Any object: a random model's keys run on, so the bias pulls a "}" as soon as the
    # grammar allows one (the bias applies after the mask: it cannot pull one before).
    [text] = completion(server, response_format={"type": "json_object"}, logit_bias={"125": 100})
    assert text == "{}"


def test_a_streamed_chat_follows_its_json_schema_as_the_whole_answer_does(server):
    client = server.client()
    body: dict[str, Any] = {
        "model": None, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 1.0,
        "seed": 3, "response_format": {"type": "json_schema", "json_schema": {
            "name": "record", "schema": SCHEMA, "strict": True}},
    }  # fmt: skip
    whole = client.chat.completions.create(**body)
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(**body, stream=True)
        if chunk.choices
    ]
    text = whole.choices[0].message.content
    assert "".join(pieces) == text
    jsonschema.validate(json.loads(text), SCHEMA)


def test_the_sdks_parse_helper_returns_the_pydantic_model(server):
    client = server.client()
    for seed in range(4):
        answer = client.chat.completions.parse(
            model=None,  # type: ignore[arg-type]
            messages=CHAT,  # type: ignore[arg-type]
            response_format=Record,
            max_tokens=MAX_TOKENS,
            temperature=1.0,
            seed=seed,
        )
        record = answer.choices[0].message.parsed
        assert isinstance(record, Record), answer.choices[0].message.content
        assert 0 <= record.id <= 999 and len(record.inner.xs) <= 3


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "objekt"}}}},
     "response_format.json_schema.schema", "objekt"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex",
     "unclosed character class"),
    ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar",
     'unknown name: "foo"'),
    ({"guided_json": "{not json"}, "guided_json", "not JSON"),
    ({"guided_choice": ["a", 1]}, "guided_choice.1", "string"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice",
     "give one structured output"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs it"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param", "said"), BAD, ids=[p for _, p, _ in BAD])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_spec_that_does_not_compile_is_a_400_naming_its_field(server, body, param, said, path):
    ask = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": CHAT}
    answer = server.post(path, {**ask, "max_tokens": 4, **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and said in error["message"], error


def test_a_large_schema_compiles_off_the_event_loop_which_answers_meanwhile(server):
    """A schema that takes the backend most of a second to refuse (15,000 properties, the
    last with a broken pattern): /health, asked once the server has begun the request (it
    logs the request's unknown field just before), is answered before it."""
    marker = f"x_probe_{uuid.uuid4().hex[:8]}"  # an unknown field: logged as ignored
    properties: dict[str, Any] = {
        f"p{i}": {"type": "string", "pattern": f"^a{i}[bc]+$"} for i in range(15_000)
    }
    properties["last"] = {"type": "string", "pattern": "^("}
    body = json.dumps({
        "prompt": PROMPT, "max_tokens": 2,
        "structured_outputs": {"json": {"type": "object", "properties": properties}},
        marker: True,
    }).encode()  # fmt: skip
    host, port = server.url.removeprefix("http://").split(":")
    heavy = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
        f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
    health = f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
    with (
        socket.create_connection((host, int(port)), timeout=60) as first,
        socket.create_connection((host, int(port)), timeout=60) as second,
        selectors.DefaultSelector() as selector,
    ):
        first.sendall(heavy)
        server.launch.wait_for_event(
            "server.fields_ignored", log="frontend-0", fields=[marker], timeout=60
        )
        second.sendall(health)
        selector.register(first, selectors.EVENT_READ, "the schema's answer")
        selector.register(second, selectors.EVENT_READ, "/health")
        ready = selector.select(timeout=60)
        assert ready, "neither answered"
        assert ready[0][0].data == "/health", [key.data for key, _ in ready]
        answer = b"".join(iter(lambda: first.recv(1 << 16), b""))
    assert answer.startswith(b"HTTP/1.1 400"), answer[:200]
    assert b"structured_outputs.json" in answer and b"unclosed group" in answer

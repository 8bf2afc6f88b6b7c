"""Tools on a model whose chat template teaches no tool-call format (issue 49): SmolLM2-135M-
Instruct served by ``ringfence serve`` (tests/clients/conftest.py), through the openai SDK.

``required`` and a named function are forced by the grammar to vLLM's JSON forms (a list of
calls; the named function's arguments) and read back into ``tool_calls``, whole or
streamed; ``auto`` has no format to read and answers text, so the SDK's tool loop runs.
The tool loop and the stream helper also run through ``ringfence router`` (in this process:
tests/routing.py) over the package's instance, and over a prefill and a decode instance of
the same file sharing a tier (``--prefill/--decode``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest
from client_runs import model_file
from routing import routed_urls
from serving import Server, served, started
from tool_schemas import SCHEMAS, TOOLS

pytest.importorskip("openai", reason="the client under test (the test extra installs openai)")

MAX_TOKENS = 48  # room for a forced call's JSON
TEXT_TOKENS = 12  # an answer in text: only that it is text (and which) is checked
ASK = [{"role": "user", "content": "What is the weather in Rome for three days?"}]


@pytest.fixture(scope="module")
def router_url(smollm2_server: Server) -> Iterator[str]:
    """``ringfence router --instance`` over the package's instance."""
    with routed_urls([], [], instances=(smollm2_server.url,)) as rig:
        yield rig.url


@pytest.fixture(scope="module")
def pd_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``ringfence router --prefill P --decode D``: two instances of the file, one tier."""
    tmp = tmp_path_factory.mktemp("tools-pd")
    sets = (f"model.path={model_file()}", "model.dtype=float32",
            "cache.storage.backend=local", f"cache.storage.path={tmp / 'tier'}")  # fmt: skip
    for name in ("prefill", "decode"):
        (tmp / name).mkdir()
    with contextlib.ExitStack() as stack:
        prefill, decode = started(stack, [
            served(tmp / "prefill", *sets, "engine.role=prefill"),
            served(tmp / "decode", *sets, "engine.role=decode", "sched.preemption=save"),
        ])  # fmt: skip
        with routed_urls([prefill.url], [decode.url]) as rig:
            yield rig.url


@dataclass(frozen=True)
class Endpoint:
    """Where the SDK is pointed: an instance or a router."""

    url: str

    def client(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, **kwargs)


# The prefill/decode pair starts two more instances of the file (most of this module's
# time): it runs with the slow soaks; CI keeps the instance and the router in front of it.
@pytest.fixture(params=["direct", "router", pytest.param("pd", marks=pytest.mark.slow)])
def via(request: pytest.FixtureRequest) -> Endpoint:
    """The package's instance, or a router in front of it or of a prefill/decode pair."""
    if request.param == "direct":
        return Endpoint(request.getfixturevalue("smollm2_server").url)
    return Endpoint(request.getfixturevalue(f"{request.param}_url"))


def chat(server: Server | Endpoint, **body: Any) -> Any:
    return server.client(timeout=240).chat.completions.create(  # type: ignore[call-overload]
        model=None,  # the served one
        messages=body.pop("messages", ASK),
        max_tokens=body.pop("max_tokens", MAX_TOKENS),
        temperature=1.0,
        tools=TOOLS,
        **body,
    )


def check_call(call: Any, name: str | None = None) -> None:
    """A call of one of TOOLS (of ``name`` if given), its arguments valid for it."""
    print(f"called: {call.function.name} {call.function.arguments}")
    assert call.type == "function" and call.id.startswith("call_")
    assert name is None or call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_yields_calls_of_the_tools_for_each_choice(smollm2_server: Server) -> None:
    answer = chat(smollm2_server, tool_choice="required", seed=3, n=2)
    for choice in answer.choices:
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.content is None and choice.message.tool_calls
        for call in choice.message.tool_calls:
            check_call(call)


def test_a_named_function_is_called_with_arguments_its_schema_takes(
    smollm2_server: Server,
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    answer = chat(smollm2_server, tool_choice=named, seed=4)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    check_call(call, "get_weather")


def test_auto_answers_text_where_the_template_teaches_no_format(smollm2_server: Server) -> None:
    answer = chat(smollm2_server, seed=5, max_tokens=TEXT_TOKENS)  # tool_choice absent: auto
    choice = answer.choices[0]
    assert not choice.message.tool_calls and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    plain = chat(smollm2_server, seed=5, tool_choice="none", max_tokens=TEXT_TOKENS)
    assert plain.choices[0].message.content == choice.message.content  # read as none reads it


def test_the_sdks_stream_helper_assembles_the_forced_calls(via: Endpoint) -> None:
    # One call at most: the grammar's list then holds one (the model would go on calling).
    for choice_asked in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        whole = chat(via, tool_choice=choice_asked, seed=6, parallel_tool_calls=False)
        expected = whole.choices[0].message.tool_calls
        with via.client(timeout=240).chat.completions.stream(
            model=whole.model, messages=ASK,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS, temperature=1.0, seed=6,
            tools=TOOLS, tool_choice=choice_asked, parallel_tool_calls=False,  # type: ignore[arg-type]
        ) as stream:  # fmt: skip
            kinds = [event.type for event in stream]
            final = stream.get_final_completion()
        [call] = calls = final.choices[0].message.tool_calls or []
        check_call(call)
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (c.function.name, c.function.arguments) for c in expected
        ], choice_asked
        assert kinds.count("tool_calls.function.arguments.delta") > 1, kinds
        assert kinds.count("tool_calls.function.arguments.done") == 1
        assert final.choices[0].finish_reason == "tool_calls"


def test_the_sdks_tool_loop_calls_then_answers_from_the_tools_result(via: Endpoint) -> None:
    first = chat(via, tool_choice="required", seed=2)
    message = first.choices[0].message
    messages: list[Any] = [*ASK, message.model_dump(exclude_none=True)]
    for call in message.tool_calls:
        check_call(call)
        result = {"forecast": "sun", "for": json.loads(call.function.arguments)}
        messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    second = chat(via, messages=messages, seed=2, max_tokens=TEXT_TOKENS)  # auto: the SDK's loop
    choice = second.choices[0]
    print(f"answered: {choice.message.content!r}")
    assert not choice.message.tool_calls and choice.message.content
    assert choice.finish_reason in ("stop", "length")

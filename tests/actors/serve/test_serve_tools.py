"""Tools on chat completions (issues 38 and 49) through ``ringfence serve`` and the openai SDK.

The model is a tiny GGUF file (random weights, a byte-level vocabulary) whose chat template
teaches the Hermes format (``<tool_call>``), as Qwen's does: so ``tool_choice`` required
and named are the grammar's doing, and ``auto`` reads back whatever the model wrote. Other
files teach Llama 3's JSON, Mistral's ``[TOOL_CALLS]`` list (a control token of its own)
and the pythonic list; ``auto`` is shown reading each by a structured output that makes the
random model write a call. The presets' plain template teaches no format: ``auto`` answers
text there, ``required`` and a named function are forced to vLLM's JSON forms.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from gguf_files import CONTROL_TOKENS, TINY, tiny_weights, write_tiny
from serving import Server, served
from tool_schemas import SCHEMAS, TOOLS

from ringfence.actors.serve.tools import ToolStream, ToolUse, answer_decoder
from ringfence.actors.text.tokenizer import load_tokenizer
from ringfence.actors.text.tool_calls import FORMATS

HERMES_TEMPLATE = (
    # The tools by name only: the model's context is 512 byte tokens.
    "{%- if tools %}<|im_start|>system\n<tools>"
    "{%- for tool in tools %}{{ tool.function.name }} {% endfor %}</tools>\n"
    "Call one as <tool_call>\n{...}\n</tool_call><|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{%- for c in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments }}}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama 3.1's shape, cut short: the tools by name, calls as JSON with "parameters".
LLAMA3_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nEnvironment: ipython\n<tools>"
    "{%- for tool in tools %}{{ tool.function.name }} {% endfor %}</tools>\n"
    'Answer with {"name": ..., "parameters": ...}<|im_end|>\n{%- endif %}'
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Mistral's shape, cut short: calls as a JSON list after [TOOL_CALLS], a control token.
MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{% for tool in tools %}{{ tool.function.name }} "
    "{% endfor %}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS]["
    '{%- for c in m.tool_calls %}{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments }}}{% if not loop.last %}, {% endif %}{% endfor %}]"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- else %}[INST]{{ m.content }}[/INST]{% endif %}{%- endfor %}"
)
TOOL_CALLS_ID = 259  # the Mistral file's control token after the three of TINY
MISTRAL_CONTROLS = (*CONTROL_TOKENS, "[TOOL_CALLS]")
# Llama 3.2's pythonic template's shape, cut short.
PYTHONIC_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {% for tool in tools %}{{ tool.function.name }} "
    "{% endfor %}\nCall as [func_name1(params_name1=params_value1)]<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]
MAX_TOKENS = 96


@contextmanager
def tiny_served(tmp: Path, name: str, seed: int, template: str) -> Iterator[Server]:
    """``ringfence serve`` of a tiny GGUF file (random weights of ``seed``) whose chat
    template is ``template``."""
    file = write_tiny(tmp / f"{name}.gguf", tiny_weights(seed), template=template)
    with served(tmp, f"model.path={file}", "model.dtype=float32") as server:
        yield server


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with tiny_served(tmp_path_factory.mktemp("tools"), "hermes", 38, HERMES_TEMPLATE) as server:
        yield server


@pytest.fixture(scope="module")
def llama3_server(tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("tools-llama3")
    with tiny_served(tmp, "llama3", 39, LLAMA3_TEMPLATE) as server:
        yield server


@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("tools-mistral")
    shape = dataclasses.replace(TINY, vocab_size=TOOL_CALLS_ID + 1)
    file = write_tiny(tmp / "mistral.gguf", tiny_weights(40, shape), shape=shape,
                      template=MISTRAL_TEMPLATE, controls=MISTRAL_CONTROLS)  # fmt: skip
    with served(tmp, f"model.path={file}", "model.dtype=float32") as server:
        yield server


@pytest.fixture(scope="module")
def pythonic_server(tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("tools-pythonic")
    with tiny_served(tmp, "pythonic", 41, PYTHONIC_TEMPLATE) as server:
        yield server


def chat(server: Server, **body: Any) -> Any:
    return server.client().chat.completions.create(  # type: ignore[call-overload]
        model=None,  # the served one
        messages=body.pop("messages", ASK),
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        **body,
    )


def check_call(call: Any) -> None:
    """A call of one of TOOLS, its arguments valid for the function's parameters."""
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_always_yields_a_call_for_every_choice_and_seed(server):
    for seed in range(3):
        answer = chat(server, tools=TOOLS, tool_choice="required", seed=seed, n=2)
        for choice in answer.choices:
            assert choice.finish_reason == "tool_calls", choice.message
            [call] = choice.message.tool_calls
            check_call(call)
            assert choice.message.content is None


def test_llama3s_json_form_is_forced_read_back_and_streamed_alike(llama3_server):
    whole = chat(llama3_server, tools=TOOLS, tool_choice="required", seed=6)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    check_call(call)
    chunks = list(chat(llama3_server, tools=TOOLS, tool_choice="required", seed=6, stream=True))
    [streamed] = calls_of([c.choices[0].delta for c in chunks if c.choices])
    assert [streamed["name"], streamed["arguments"]] == [
        call.function.name,
        call.function.arguments,
    ]


def test_a_named_function_is_the_one_called(server):
    named = {"type": "function", "function": {"name": "get_time"}}
    answer = chat(server, tools=TOOLS, tool_choice=named, seed=1)
    [call] = answer.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {}


def calls_of(deltas: list[Any]) -> list[dict[str, Any]]:
    """The calls a stream's deltas add up to, as a client assembles them: a call's first
    delta has its id, type and name, later ones (by index) add to its arguments."""
    calls: list[dict[str, Any]] = []
    for delta in deltas:
        for piece in delta.tool_calls or ():
            if piece.id is not None:
                assert piece.index == len(calls) and piece.type == "function"
                assert piece.id.startswith("call_") and piece.function.name
                calls.append({"name": piece.function.name, "arguments": ""})
            else:
                assert piece.function.name is None and piece.index == len(calls) - 1
            calls[piece.index]["arguments"] += piece.function.arguments
    return calls


def test_a_streamed_call_adds_up_to_the_whole_answers_its_arguments_in_pieces(server):
    whole = chat(server, tools=TOOLS, tool_choice="required", seed=4)
    [expected] = whole.choices[0].message.tool_calls
    chunks = list(chat(server, tools=TOOLS, tool_choice="required", seed=4, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    [call] = calls_of(deltas)
    assert call == {"name": expected.function.name, "arguments": expected.function.arguments}
    # The arguments come as the model writes them: a delta per token or so, not at the end.
    pieces = [p for d in deltas for p in d.tool_calls or () if p.id is None]
    assert len(pieces) > 3, pieces
    assert "".join(d.content or "" for d in deltas) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_the_sdks_stream_helper_assembles_the_call_from_its_argument_deltas(server):
    whole = chat(server, tools=TOOLS, tool_choice="required", seed=5)
    [expected] = whole.choices[0].message.tool_calls
    with server.client().chat.completions.stream(
        model=whole.model, messages=ASK, max_tokens=MAX_TOKENS, temperature=1.0, seed=5,
        tools=TOOLS, tool_choice="required",
    ) as stream:  # fmt: skip
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert kinds.count("tool_calls.function.arguments.delta") > 3, kinds
    assert kinds.count("tool_calls.function.arguments.done") == 1
    [call] = final.choices[0].message.tool_calls or []
    assert (call.function.name, call.function.arguments) == (
        expected.function.name, expected.function.arguments)  # fmt: skip
    assert final.choices[0].finish_reason == "tool_calls"


def test_the_sdks_tool_loop_takes_the_call_and_answers_from_the_tools_result(server):
    first = chat(server, tools=TOOLS, tool_choice="required", seed=2)
    message = first.choices[0].message
    [call] = message.tool_calls
    result = {"forecast": "sun", "for": json.loads(call.function.arguments)}
    messages = [
        *ASK,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)},
    ]
    second = chat(server, messages=messages, tools=TOOLS, tool_choice="none", seed=2)
    choice = second.choices[0]
    assert not choice.message.tool_calls and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    # The tool's result reached the prompt: the template rendered the call and the result.
    tokens = server.post("/tokenize", {"messages": messages}).json()["tokens"]
    rendered = bytes(t for t in tokens if t < 256).decode()
    assert "<tool_response>" in rendered and call.function.name in rendered


BAD = [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
     "tool_choice.function.name", "'rm' is not one of the tools"),
    ({"tools": TOOLS, "tool_choice": "required", "structured_outputs": {"regex": "a"}},
     "tool_choice", "cannot be combined"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "same name"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {
        "name": "f", "parameters": {"type": "objekt"}}}], "tool_choice": "required"},
     "tools.1.function.parameters", "objekt"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param", "said"), BAD, ids=[p for _, p, _ in BAD])
def test_a_tool_request_it_cannot_honour_is_a_400_naming_the_field(server, body, param, said):
    answer = server.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and said in error["message"], error


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


def forced_whole_and_streamed(server: Server, choice: Any, seed: int) -> Any:
    """The one call ``choice`` forces (one at most: parallel_tool_calls false), checked, and
    the same request streamed adding up to it."""
    whole = chat(server, tools=TOOLS, tool_choice=choice, seed=seed, parallel_tool_calls=False)
    answer = whole.choices[0]
    assert answer.finish_reason == "tool_calls" and answer.message.content is None, answer
    [call] = answer.message.tool_calls
    check_call(call)
    if isinstance(choice, dict):
        assert call.function.name == choice["function"]["name"]
    chunks = chat(server, tools=TOOLS, tool_choice=choice, seed=seed, stream=True,
                  parallel_tool_calls=False)  # fmt: skip
    assert calls_of([c.choices[0].delta for c in chunks if c.choices]) == [
        {"name": call.function.name, "arguments": call.function.arguments}
    ]
    return call


@pytest.mark.parametrize("choice", ["required", NAMED_WEATHER], ids=["required", "named"])
def test_a_template_without_a_tool_format_is_forced_to_the_json_forms(tiny_server, choice):
    forced_whole_and_streamed(tiny_server, choice, seed=3)


def test_auto_on_a_template_without_a_tool_format_answers_the_text_none_would(tiny_server):
    body = {"messages": ASK, "max_tokens": 8, "temperature": 1.0, "seed": 4, "tools": TOOLS}
    auto = tiny_server.post("/v1/chat/completions", body)
    assert auto.status_code == 200, auto.text
    [choice] = auto.json()["choices"]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] != "tool_calls"
    none = tiny_server.post("/v1/chat/completions", {**body, "tool_choice": "none"}).json()
    assert choice["message"]["content"] == none["choices"][0]["message"]["content"]


@pytest.mark.parametrize("choice", ["required", NAMED_WEATHER], ids=["required", "named"])
def test_a_mistral_template_is_forced_to_its_json_list_without_the_tag(mistral_server, choice):
    forced_whole_and_streamed(mistral_server, choice, seed=7)


def test_auto_reads_a_mistral_call_after_its_control_token_kept_in_the_text(mistral_server):
    # The random model is made to write the control token itself, then a call.
    writes = {"grammar": f'start: <[{TOOL_CALLS_ID}]> "[{{\\"name\\":\\"get_time\\",'
                         '\\"arguments\\":{}}]"'}  # fmt: skip
    answer = chat(mistral_server, tools=TOOLS, seed=1, extra_body={"structured_outputs": writes})
    [call] = answer.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_time", "{}")
    assert answer.choices[0].finish_reason == "tool_calls"
    chunks = chat(mistral_server, tools=TOOLS, seed=1, stream=True,
                  extra_body={"structured_outputs": writes})  # fmt: skip
    assert calls_of([c.choices[0].delta for c in chunks if c.choices]) == [
        {"name": "get_time", "arguments": "{}"}
    ]
    # Without tools the control token is skipped, as every special token is.
    plain = chat(mistral_server, seed=1, extra_body={"structured_outputs": writes})
    assert plain.choices[0].message.content == '[{"name":"get_time","arguments":{}}]'


def test_the_decoder_keeps_the_formats_token_only_for_the_format_that_reads_it(tmp_path):
    shape = dataclasses.replace(TINY, vocab_size=TOOL_CALLS_ID + 1)
    file = write_tiny(tmp_path / "m.gguf", tiny_weights(1, shape), shape=shape,
                      controls=MISTRAL_CONTROLS)  # fmt: skip
    tokenizer = load_tokenizer(file)
    assert tokenizer is not None
    ids = [*b"Hi ", TOOL_CALLS_ID, *b"[]", 256]  # 256: <|endoftext|>, skipped always
    mistral = ToolUse(format=FORMATS["mistral"], tools=(), forced=None)
    assert answer_decoder(tokenizer, mistral)(ids) == "Hi [TOOL_CALLS][]"
    hermes = ToolUse(format=FORMATS["hermes"], tools=(), forced=None)
    for use in (hermes, None):
        assert answer_decoder(tokenizer, use)(ids) == "Hi []"


@pytest.mark.parametrize("choice", ["required", NAMED_WEATHER], ids=["required", "named"])
def test_a_pythonic_template_is_forced_to_the_json_forms(pythonic_server, choice):
    forced_whole_and_streamed(pythonic_server, choice, seed=8)


def test_auto_reads_a_pythonic_call_list_with_ast(pythonic_server):
    writes = {"regex": r'\[get_weather\(city="(Rome|Oslo)", days=[1-7]\)\]'}
    answer = chat(pythonic_server, tools=TOOLS, seed=2, extra_body={"structured_outputs": writes})
    [call] = answer.choices[0].message.tool_calls
    check_call(call)
    chunks = chat(pythonic_server, tools=TOOLS, seed=2, stream=True,
                  extra_body={"structured_outputs": writes})  # fmt: skip
    assert calls_of([c.choices[0].delta for c in chunks if c.choices]) == [
        {"name": call.function.name, "arguments": call.function.arguments}
    ]


def test_a_stream_sends_content_then_each_calls_start_and_arguments_as_they_come():
    def run(pieces: list[str]) -> list[dict[str, Any]]:
        stream = ToolStream(ToolUse(format=FORMATS["hermes"], tools=(), forced=None))
        return [d for i, p in enumerate(pieces) for d in stream.take(p, i == len(pieces) - 1)]

    # Text is sent once it cannot begin a call.
    assert run(["x", "a <", "b", " c"]) == [
        {"content": "x"}, {"content": "a"}, {"content": " <b"}, {"content": " c"}
    ]  # fmt: skip
    sent = run(["Let me see. <tool", '_call>\n{"name": "get_time", "arguments": {"tz',
                '": "', 'UTC"}', '}\n</tool_call>'])  # fmt: skip
    assert sent[0] == {"content": "Let me see."}  # the text before the call, as parse gives it
    [start] = sent[1]["tool_calls"]
    assert start["id"].startswith("call_") and start["index"] == 0
    # The head's piece starts the call (with what it had of the arguments); each later piece
    # adds to them.
    assert start["function"] == {"name": "get_time", "arguments": '{"tz'}
    assert [d["tool_calls"] for d in sent[2:]] == [
        [{"index": 0, "function": {"arguments": '": "'}}],
        [{"index": 0, "function": {"arguments": 'UTC"}'}}],
    ]


def test_with_parallel_tool_calls_false_an_answer_holds_its_first_call_only():
    two = (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'
    )
    one = ToolUse(format=FORMATS["hermes"], tools=(), forced=None, most=1)
    assert [c.name for c in one.parse(two).calls] == ["get_time"]
    every = ToolUse(format=FORMATS["hermes"], tools=(), forced=None)
    assert [c.name for c in every.parse(two).calls] == ["get_time", "get_weather"]
    stream = ToolStream(one)
    sent = [d for piece in (two[:40], two[40:90], two[90:]) for d in stream.take(piece, False)]
    sent += stream.take("", True)
    pieces = [p for d in sent for p in d.get("tool_calls", ())]
    assert {p["index"] for p in pieces} == {0} and pieces[0]["function"]["name"] == "get_time"
    assert "".join(p["function"]["arguments"] for p in pieces) == "{}"
    assert not any("content" in d for d in sent)

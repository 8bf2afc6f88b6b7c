"""Tool-call formats (actors/text/tool_calls.py): which a chat template teaches, how calls
read back out of an answer, and the grammar that forces a call accepting exactly the calls
of the functions it names. How a stream reads them: test_call_reader.py."""

from __future__ import annotations

import json

import pytest

from ringfence.actors.text.grammars import model_grammars
from ringfence.actors.text.tokenizer import EOS, VOCAB_SIZE
from ringfence.actors.text.tool_calls import (
    FORMATS,
    Function,
    Parsed,
    ToolCall,
    tool_format,
)
from ringfence.sched.structured import StructuredOutput

WEATHER = Function(
    name="get_weather",
    parameters={"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                "required": ["city"], "additionalProperties": False},
)  # fmt: skip
TIME = Function(name="get_time", parameters={})
HERMES, LLAMA = FORMATS["hermes"], FORMATS["llama3_json"]


def test_the_format_is_the_one_the_template_writes():
    assert tool_format("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert tool_format("{{- '<|python_tag|>' }}") is LLAMA
    assert tool_format("{% if m.role == 'ipython' %}{% endif %}") is LLAMA
    assert tool_format("{{ messages }}") is None and tool_format(None) is None


def test_hermes_calls_read_back_with_the_text_before_them():
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert HERMES.parse(text) == Parsed(
        content="Let me look.",
        calls=(ToolCall(name="get_weather", arguments='{"city": "Rome"}'),
               ToolCall(name="get_time", arguments="{}")),
    )  # fmt: skip
    assert HERMES.parse("no call") == Parsed(content="no call", calls=())
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert HERMES.parse(broken) == Parsed(content=broken, calls=())
    # Keys in another order: the block is read whole, its arguments re-serialized.
    swapped = '<tool_call>{"arguments": {"days":2}, "name": "f"}</tool_call> Done.'
    assert HERMES.parse(swapped) == Parsed(
        content=" Done.", calls=(ToolCall(name="f", arguments='{"days": 2}'),)
    )
    # A call cut short (finish_reason length) keeps the arguments written so far.
    cut = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro'
    assert HERMES.parse(cut).calls == (ToolCall(name="get_weather", arguments='{"city": "Ro'),)


def test_llama3_calls_read_back_with_or_without_the_python_tag():
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert LLAMA.parse(one).calls == (ToolCall(name="get_weather", arguments='{"city": "Paris"}'),)
    two = '<|python_tag|>{"name": "get_time", "parameters": {}}; ' + one
    assert [c.name for c in LLAMA.parse(two).calls] == ["get_time", "get_weather"]
    assert LLAMA.parse("{ is not a call").calls == ()
    assert LLAMA.parse("Hello").content == "Hello"


@pytest.mark.parametrize("fmt", [HERMES, LLAMA], ids=lambda f: f.name)
def test_the_forcing_grammar_takes_a_call_of_a_named_function_and_nothing_else(fmt):
    grammars = model_grammars("", VOCAB_SIZE)
    spec = StructuredOutput(kind="grammar", source=fmt.grammar([WEATHER, TIME]))
    args = fmt.arguments_key
    calls = [{"name": "get_weather", args: {"city": "Rome"}}, {"name": "get_time", args: {}}]
    wrong = [{"name": "get_weather", args: {"city": "Oslo"}}, {"name": "rm", args: {}}]
    for call, allowed in [*((c, True) for c in calls), *((c, False) for c in wrong)]:
        body = json.dumps(call, separators=(",", ":"))
        text = f"<tool_call>\n{body}\n</tool_call>" if fmt is HERMES else body
        matcher = grammars.matcher(spec)
        ok = matcher.consume_tokens(list(text.encode()))
        assert ok == allowed, (call, matcher.get_error())
        if ok:
            assert matcher.consume_token(EOS) and matcher.is_stopped()
            assert fmt.parse(text).calls[0].name == call["name"]

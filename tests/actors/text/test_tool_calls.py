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
    JSON_CALLS,
    Function,
    NamedArguments,
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
MISTRAL, PYTHONIC = FORMATS["mistral"], FORMATS["pythonic"]


def test_the_format_is_the_one_the_template_writes():
    assert tool_format("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert tool_format("{{- '<|python_tag|>' }}") is LLAMA
    assert tool_format("{% if m.role == 'ipython' %}{% endif %}") is LLAMA
    assert tool_format("{{- '[TOOL_CALLS]' + tool_calls|tojson }}") is MISTRAL
    pythonic = "[func_name1(params_name1=params_value1), func_name2(params)] ipython"
    assert tool_format(pythonic) is PYTHONIC
    assert tool_format("{{- '<|python_start|>' }}{% if m.role == 'ipython' %}") is PYTHONIC
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


def test_mistral_calls_are_a_list_after_its_tag_with_the_text_before_them():
    text = (
        'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}, '
        '{"name": "get_time", "arguments": {}}]'
    )
    assert MISTRAL.parse(text) == Parsed(
        content="Checking.",
        calls=(ToolCall(name="get_weather", arguments='{"city": "Rome"}'),
               ToolCall(name="get_time", arguments="{}")),
    )  # fmt: skip
    assert MISTRAL.keep == "[TOOL_CALLS]"
    swapped = '[TOOL_CALLS][{"arguments": {"days": 2}, "name": "f"}]'
    assert MISTRAL.parse(swapped).calls == (ToolCall(name="f", arguments='{"days": 2}'),)
    for not_calls in ["[TOOL_CALLS] none here", "[TOOL_CALLS][1, 2]", "no tag [{}]"]:
        assert MISTRAL.parse(not_calls) == Parsed(content=not_calls, calls=()), not_calls


def test_pythonic_calls_are_read_with_ast_never_run(tmp_path):
    text = '[get_weather(city="Rome", days=2), get_time()]'
    assert PYTHONIC.parse(text).calls == (
        ToolCall(name="get_weather", arguments='{"city": "Rome", "days": 2}'),
        ToolCall(name="get_time", arguments="{}"),
    )
    tagged = '<|python_start|>[f(a=[1, None], b={"k": True})]<|python_end|>'
    assert PYTHONIC.parse(tagged).calls == (
        ToolCall(name="f", arguments='{"a": [1, null], "b": {"k": true}}'),
    )
    assert [c.name for c in PYTHONIC.parse(text, most=1).calls] == ["get_weather"]
    mark = tmp_path / "ran"
    for not_calls in [
        f"[__import__('pathlib').Path({str(mark)!r}).touch()]",  # not a plain name's call
        f"[open(file={str(mark)!r}, mode=print('x'))]",  # an argument that is no literal
        "[f(1)]", "[1, 2]", "Rome is sunny.", "[f(a=1)", "  [f(a={1, 2})]",
    ]:  # fmt: skip
        assert PYTHONIC.parse(not_calls) == Parsed(content=not_calls, calls=()), not_calls
    assert not mark.exists()


def test_a_pythonic_list_streams_its_calls_once_it_closes():
    reader = PYTHONIC.reader()
    assert reader.feed(" [get_time(), get_weather(city=") == []
    assert [e.kind for e in reader.feed('"Rome")]')] == ["call", "arguments", "call", "arguments"]
    assert reader.feed(" and more", last=True) == []
    text = PYTHONIC.reader()  # not a list first: content as it comes
    sent = [*text.feed("Hello [x"), *text.feed("]", last=True)]
    assert [e.text for e in sent] == ["Hello [x", "]"]


def test_the_json_forms_read_back_the_calls_the_grammar_forces():
    two = '[{"name":"get_time","arguments":{}},{"name":"get_weather","arguments":{"city":"Rome"}}]'
    assert JSON_CALLS.parse(two).calls == (
        ToolCall(name="get_time", arguments="{}"),
        ToolCall(name="get_weather", arguments='{"city":"Rome"}'),
    )
    named = NamedArguments("get_weather")
    assert named.parse('{"city":"Rome"}') == Parsed(
        content=None, calls=(ToolCall(name="get_weather", arguments='{"city":"Rome"}'),)
    )


def test_the_json_lists_grammar_takes_calls_of_the_named_functions_only():
    fmt = JSON_CALLS
    grammars = model_grammars("", VOCAB_SIZE)
    spec = StructuredOutput(kind="grammar", source=fmt.grammar([WEATHER, TIME]))
    good = [{"name": "get_weather", "arguments": {"city": "Rome"}},
            {"name": "get_time", "arguments": {}}]  # fmt: skip
    bad = [{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "rm", "arguments": {}}]
    cases = [(good[:1], True), (good, True), *(([b], False) for b in bad), ([], False)]
    for calls, allowed in cases:
        text = "[" + ",".join(json.dumps(c, separators=(",", ":")) for c in calls) + "]"
        matcher = grammars.matcher(spec)
        ok = matcher.consume_tokens(list(text.encode())) and matcher.consume_token(EOS)
        assert ok == allowed, (text, matcher.get_error())
        if ok:
            assert [c.name for c in fmt.parse(text).calls] == [c["name"] for c in calls]


def test_a_named_functions_grammar_takes_its_arguments_only():
    grammars = model_grammars("", VOCAB_SIZE)
    spec = StructuredOutput(kind="grammar", source=NamedArguments("get_weather").grammar([WEATHER]))
    for text, allowed in [('{"city":"Rome"}', True), ('{"city":"Oslo"}', False),
                          ('{"name":"get_weather"}', False)]:  # fmt: skip
        matcher = grammars.matcher(spec)
        ok = matcher.consume_tokens(list(text.encode())) and matcher.consume_token(EOS)
        assert ok == allowed, (text, matcher.get_error())
    for fmt in (PYTHONIC, MISTRAL):  # forced through the JSON forms instead
        assert fmt.grammar([WEATHER]) is None


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

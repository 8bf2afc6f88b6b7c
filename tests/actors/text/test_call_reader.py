"""An answer's tool calls read as its text grows (actors/text/call_reader.py): whatever
pieces the text comes in, the stream's events add up to the whole answer's parse; a call's
arguments go out as they are written, not when the call ends; an answer without calls
reads back exactly as written."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ringfence.actors.text.call_reader import STEPS, CallReader, Event, Mode, _steps, head
from ringfence.actors.text.tool_calls import FORMATS, ToolFormat

HERMES, LLAMA = FORMATS["hermes"], FORMATS["llama3_json"]
MISTRAL, PYTHONIC, JSON_CALLS = FORMATS["mistral"], FORMATS["pythonic"], FORMATS["json"]
# Pieces of answers, well and badly formed: tags, a call's head, values with brackets,
# escapes and tags inside strings, and bare text.
HERMES_PIECES = [
    "Let me see.", " ", "\n", "<tool_call>", "</tool_call>", "<tool", "<", "{bad", "}",
    '{"name": "get_weather", "arguments": ', '{"name":"f","arguments":',
    '{"city": "R}o<\\"me", "days": [1, {"n": 2}]}', '{"arguments": {}, "name": "g"}', "5",
    '"name"', ":", ",", '{"say": "a</tool_call>"}',
]  # fmt: skip
LLAMA_PIECES = [
    " ", "\n", "<|python_tag|>", "<|py", "Hello", "{", "}", ";", '"name"', ":",
    '{"name": "f", "parameters": ', '{"a": "x;y", "b": [1]}', ', "parameters": ', '"g"',
]  # fmt: skip

LIST_PIECES = [
    " ", "\n", "Sure.", "[TOOL_CALLS]", "[TOOL", "[", "]", ",", "{", "}", '"name"', ":",
    '{"name": "f", "arguments": ', '{"name":"g","arguments":', '{"a": "x,]y", "b": [1]}',
    '{"arguments": {}, "name": "h"}', "get_time()", 'f(a="],")', "<|python_start|>", "(",
]  # fmt: skip


def fold(events: list[Event]) -> tuple[str, list[list[str]]]:
    """The content and [name, arguments] of each call that ``events`` add up to."""
    content, calls = "", list[list[str]]()
    for e in events:
        if e.kind == "content":
            content += e.text
        elif e.kind == "call":
            assert e.index == len(calls)
            calls.append([e.text, ""])
        else:
            calls[e.index][1] += e.text
    return content, calls


def streamed(fmt: ToolFormat, pieces: list[str], most: int | None = None) -> list[Event]:
    reader = fmt.reader(most)
    return [e for i, p in enumerate(pieces) for e in reader.feed(p, i == len(pieces) - 1)]


def answers(pieces: list[str]) -> Any:
    """An answer and the pieces a stream brings it in."""
    text = st.lists(st.sampled_from(pieces), max_size=8).map("".join)
    return text.flatmap(
        lambda t: st.lists(st.integers(0, len(t)), max_size=6).map(
            lambda cuts: [
                t[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(t)], strict=True)
            ]
        )
    )


@settings(max_examples=400, deadline=None)
@given(hermes=answers(HERMES_PIECES), llama=answers(LLAMA_PIECES))
def test_a_stream_in_any_pieces_adds_up_to_the_whole_answers_parse(hermes, llama):
    for fmt, pieces in ((HERMES, hermes), (LLAMA, llama)):
        text = "".join(pieces)
        parsed = fmt.parse(text)
        content, calls = fold(streamed(fmt, pieces))
        assert (content or None, calls) == (
            parsed.content or None, [[c.name, c.arguments] for c in parsed.calls]
        )  # fmt: skip
        if not calls:  # no call: every character is content, as written
            assert content == text
        # One call at most (parallel_tool_calls false): the first of them, streamed alike.
        first = fmt.parse(text, most=1)
        assert [(c.name, c.arguments) for c in first.calls] == [
            (c.name, c.arguments) for c in parsed.calls[:1]
        ]  # fmt: skip
        assert fold(streamed(fmt, pieces, most=1))[1] == [
            [c.name, c.arguments] for c in first.calls
        ]


@settings(max_examples=300, deadline=None)
@given(pieces=answers(LIST_PIECES))
def test_the_list_forms_stream_in_any_pieces_as_the_whole_answer_parses(pieces):
    text = "".join(pieces)
    for fmt in (MISTRAL, JSON_CALLS, PYTHONIC):
        for most in (None, 1):
            parsed = fmt.parse(text, most)
            content, calls = fold(streamed(fmt, pieces, most))
            assert (content or None, calls) == (
                parsed.content or None, [[c.name, c.arguments] for c in parsed.calls]
            ), fmt.name  # fmt: skip
            if not calls:
                assert content == text, fmt.name


def test_a_calls_arguments_go_out_as_they_are_written():
    reader = HERMES.reader()
    sent = reader.feed('Sure. <tool_call>\n{"name": "get_weather", "argu')
    assert sent == [Event("content", "Sure.")]  # the space may precede a call: held
    assert reader.feed('ments": {"city": ') == [
        Event("call", "get_weather", 0), Event("arguments", '{"city": ', 0)
    ]  # fmt: skip
    assert reader.feed('"Rome"}') == [Event("arguments", '"Rome"}', 0)]
    assert reader.feed("}\n</tool") == []  # the call's end is no content, nor arguments
    assert reader.feed("_call>\nThat is all.", last=True) == [
        Event("content", "\nThat is all.")
    ]  # fmt: skip


def test_a_tag_inside_an_arguments_string_is_the_arguments_own():
    text = '<tool_call>{"name": "echo", "arguments": {"say": "</tool_call> and }"}}</tool_call>'
    [call] = HERMES.parse(text).calls
    assert call.arguments == '{"say": "</tool_call> and }"}'


def test_llama3_calls_start_the_answer_or_there_are_none():
    reader = LLAMA.reader()
    assert reader.feed("  <|python") == []  # may still be the tag
    assert reader.feed('_tag|>{"name": "f", "parameters": {"a"') == [
        Event("call", "f", 0), Event("arguments", '{"a"', 0)
    ]  # fmt: skip
    assert reader.feed(': "x;y"}}; {"name": "g", "parameters": {}}', last=True) == [
        Event("arguments", ': "x;y"}', 0), Event("call", "g", 1), Event("arguments", "{}", 1)
    ]  # fmt: skip
    assert LLAMA.parse('Call {"name": "f", "parameters": {}}').calls == ()


def test_a_head_is_read_as_it_grows():
    keys = ("arguments", "parameters")
    call = '{ "name" : "f\\"x" , "arguments" : {'
    for cut in range(len(call)):
        assert head(call[:cut], keys) == "need", cut
    assert head(call, keys) == (len(call) - 1, 'f"x')
    for wrong in ['{"nam!', '{"name": 5', '{"name": "f", "argz', "[", '{"name": "f"}']:
        assert head(wrong, keys) is None, wrong


def test_every_mode_has_its_step_and_a_table_without_one_is_refused():
    assert set(STEPS) == set(Mode)
    short: dict[Mode, Any] = {m: step for m, step in STEPS.items() if m is not Mode.WHOLE}
    with pytest.raises(TypeError, match=r"no step for the modes \['WHOLE'\]"):
        _steps(short)
    with pytest.raises(TypeError):
        STEPS[Mode.WHOLE] = CallReader._done  # type: ignore[index]

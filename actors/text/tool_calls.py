"""Tool calls in a model's output (issues 38 and 49): the format its chat template teaches
it, how a call reads back out of the text, and the grammar that forces one.

The formats a chat template may teach, each chosen by what the template writes
(:func:`tool_format`), as vLLM's parsers of the same names read them:

- ``hermes`` (Hermes, Qwen 2.5 and 3, and every template that writes ``<tool_call>``): each
  call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, after any text.
- ``mistral`` (templates that write ``[TOOL_CALLS]``): after any text, ``[TOOL_CALLS]`` and
  a JSON list of ``{"name": ..., "arguments": {...}}``. ``[TOOL_CALLS]`` is a special token
  of Mistral's vocabularies: :attr:`ToolFormat.keep` asks the decoder to keep its text.
- ``pythonic`` (Llama 3.2's pythonic template, Llama 4: templates that write
  ``[func_name1(`` or ``<|python_start|>``): the answer is a Python list of calls,
  ``[get_weather(city="Rome")]`` (``pythonic.py``, read with ``ast``).
- ``llama3_json`` (Llama 3.1 and later: templates that write ``<|python_tag|>`` or speak
  of ``ipython``): the whole answer is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``; several joined by ``;``).

The JSON forms read back through one :class:`CallReader` (``call_reader.py``), as the text
grows in a stream and at once for a whole answer, so both agree.

``required`` and a named function are enforced by a grammar (:meth:`ToolFormat.grammar`, a
Lark grammar embedding each function's JSON schema, compact), so such an answer is always
a call. A format without a grammar of its own (Mistral's, pythonic), or a template that
teaches none, is forced as vLLM forces every model: ``required`` to :data:`JSON_CALLS`, a
JSON list of ``{"name": ..., "arguments": {...}}`` (Mistral's own list, its tag aside), and
a named function to its arguments' object alone (:class:`NamedArguments`); both read back
into calls the same way.

Pure: no torch, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ringfence.actors.text.call_reader import CallReader, Event, Layout, Reader
from ringfence.actors.text.pythonic import PythonicReader

COMPACT = {"whitespace_flexible": False}  # llguidance's JSON style inside a grammar


@dataclass(frozen=True, slots=True, kw_only=True)
class Function:
    """A tool the request offers: its name and its parameters' JSON schema."""

    name: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolCall:
    """One call read from the output: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Parsed:
    """What an answer holds: its text outside the calls (None when there is none) and the
    calls, in order."""

    content: str | None
    calls: tuple[ToolCall, ...]


class ToolFormat:
    """One tool-call format (see the module docstring). Stateless."""

    name: ClassVar[str]
    arguments_key: ClassVar[str] = "arguments"  # the key of the call's object with them
    layout: ClassVar[Layout]  # where its calls sit in an answer
    keep: ClassVar[str | None] = None  # a special token the decoder must keep for the reader

    def parse(self, text: str, most: int | None = None) -> Parsed:
        """The answer's content and calls (its first ``most``), as its stream
        (:meth:`reader`) sends them."""
        content: list[str] = []
        calls: list[list[str]] = []
        for event in self.reader(most).feed(text, last=True):
            if event.kind == "content":
                content.append(event.text)
            elif event.kind == "call":
                calls.append([event.text, ""])
            else:
                calls[event.index][1] += event.text
        said = "".join(content)
        return Parsed(
            content=said if said or not calls else None,
            calls=tuple(ToolCall(name=name, arguments=arguments) for name, arguments in calls),
        )

    def reader(self, most: int | None = None) -> Reader:
        """A reader of one answer's text as it grows, taking its first ``most`` calls."""
        return CallReader(self.layout, most)

    def grammar(self, functions: Sequence[Function], most: int | None = None) -> str | None:
        """A Lark grammar (llguidance's) whose every sentence is a call of one of
        ``functions`` (named ones only: give one to force it), or, in the list forms, up to
        ``most`` of them (None: any number); None: the format has none (the JSON forms force
        its calls instead)."""
        return None

    def call_schema(self, functions: Sequence[Function]) -> dict[str, Any]:
        """The JSON schema of one call object of one of ``functions``."""
        shapes = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f.name},
                    self.arguments_key: dict(f.parameters) or {"type": "object"},
                },
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            }
            for f in functions
        ]
        schema: dict[str, Any] = shapes[0] if len(shapes) == 1 else {"anyOf": shapes}
        return {**schema, "x-guidance": COMPACT}


class Hermes(ToolFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    layout = Layout(open=OPEN, close=CLOSE, lead=None, separator=None)

    def grammar(self, functions: Sequence[Function], most: int | None = None) -> str:
        schema = json.dumps(self.call_schema(functions))
        return f'start: "{self.OPEN}\\n" call "\\n{self.CLOSE}"\ncall: %json {schema}'


class Llama3Json(ToolFormat):
    name = "llama3_json"
    arguments_key = "parameters"
    TAG = "<|python_tag|>"
    layout = Layout(open=None, close=None, lead=TAG, separator=";")

    def grammar(self, functions: Sequence[Function], most: int | None = None) -> str:
        return f"start: call\ncall: %json {json.dumps(self.call_schema(functions))}"


class Mistral(ToolFormat):
    """No grammar of its own: a literal ``[TOOL_CALLS]`` in a grammar is a trap where the
    vocabulary holds it as a control token (llguidance 1.9.1 masks all but that token, then
    refuses it, and the answer ends empty). Forced, its calls are the JSON list alone."""

    name = "mistral"
    TAG = "[TOOL_CALLS]"
    keep = TAG
    layout = Layout(open=TAG, close=None, lead="[", separator=",")


class Pythonic(ToolFormat):
    name = "pythonic"
    MARKS = ("[func_name1(", "<|python_start|>")  # what its templates write

    def reader(self, most: int | None = None) -> Reader:
        return PythonicReader(most)


class JsonCalls(ToolFormat):
    """``required`` on a template without a grammar of its own: a JSON list of calls."""

    name = "json"
    layout = Layout(open=None, close=None, lead="[", separator=",")

    def grammar(self, functions: Sequence[Function], most: int | None = None) -> str:
        call = {k: v for k, v in self.call_schema(functions).items() if k != "x-guidance"}
        schema = {"type": "array", "items": call, "minItems": 1, "x-guidance": COMPACT}
        if most is not None:
            schema["maxItems"] = most
        return f"start: calls\ncalls: %json {json.dumps(schema)}"


class NamedArguments(ToolFormat):
    """A named function forced on a template without a grammar of its own: the answer is
    the function's arguments alone, read back as one call of it."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def reader(self, most: int | None = None) -> Reader:
        return _ArgumentsReader(self.function)

    def grammar(self, functions: Sequence[Function], most: int | None = None) -> str:
        [named] = [f for f in functions if f.name == self.function]
        schema = {**(dict(named.parameters) or {"type": "object"}), "x-guidance": COMPACT}
        return f"start: arguments\narguments: %json {json.dumps(schema)}"


class _ArgumentsReader:
    """An answer that is one call's arguments: the call starts with the answer."""

    def __init__(self, function: str) -> None:
        self.function = function
        self.started = False

    def feed(self, text: str, last: bool = False) -> list[Event]:
        events = [] if self.started else [Event("call", self.function, 0)]
        self.started = True
        return [*events, Event("arguments", text, 0)] if text else events


JSON_CALLS = JsonCalls()
FORMATS: dict[str, ToolFormat] = {
    f.name: f for f in (Hermes(), Mistral(), Pythonic(), Llama3Json(), JSON_CALLS)
}


def tool_format(template_source: str | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches (None: it teaches none). Llama 4's
    templates also speak of ``ipython``: the pythonic marks are looked for first."""
    if not template_source:
        return None
    if Hermes.OPEN in template_source:
        return FORMATS["hermes"]
    if Mistral.TAG in template_source:
        return FORMATS["mistral"]
    if any(mark in template_source for mark in Pythonic.MARKS):
        return FORMATS["pythonic"]
    if Llama3Json.TAG in template_source or "ipython" in template_source:
        return FORMATS["llama3_json"]
    return None

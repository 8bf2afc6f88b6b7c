"""Tool calls in a model's output (issue 38): the format its chat template teaches it, how a
call reads back out of the text, and the grammar that forces one.

Two formats, each chosen by what the chat template writes (:func:`tool_format`), as vLLM's
``hermes`` and ``llama3_json`` parsers read them:

- ``hermes`` (Hermes, Qwen 2.5 and 3, and every template that writes ``<tool_call>``): each
  call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, after any text.
- ``llama3_json`` (Llama 3.1 and later: templates that write ``<|python_tag|>`` or speak
  of ``ipython``): the whole answer is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``; several joined by ``;``).

Both read back through one :class:`CallReader` (``call_reader.py``), as the text grows in a
stream and at once for a whole answer, so both agree.

A template that writes neither has no tool-call format: the front end then refuses tools
unless ``tool_choice`` is ``none``. ``required`` and a named function are enforced by a
grammar (:meth:`ToolFormat.grammar`, a Lark grammar embedding each function's JSON schema,
compact), so such an answer is always a call.

Pure: no torch, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from ringfence.actors.text.call_reader import CallReader, Layout

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
    arguments_key: ClassVar[str]  # the key of the call's object that holds the arguments
    layout: ClassVar[Layout]  # where its calls sit in an answer

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

    def reader(self, most: int | None = None) -> CallReader:
        """A reader of one answer's text as it grows, taking its first ``most`` calls."""
        return CallReader(self.layout, most)

    def grammar(self, functions: Sequence[Function]) -> str:
        """A Lark grammar (llguidance's) whose every sentence is one call of one of
        ``functions`` (named ones only: give one to force it)."""
        raise NotImplementedError

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
    arguments_key = "arguments"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    layout = Layout(open=OPEN, close=CLOSE, lead=None, separator=None)

    def grammar(self, functions: Sequence[Function]) -> str:
        schema = json.dumps(self.call_schema(functions))
        return f'start: "{self.OPEN}\\n" call "\\n{self.CLOSE}"\ncall: %json {schema}'


class Llama3Json(ToolFormat):
    name = "llama3_json"
    arguments_key = "parameters"
    TAG = "<|python_tag|>"
    layout = Layout(open=None, close=None, lead=TAG, separator=";")

    def grammar(self, functions: Sequence[Function]) -> str:
        return f"start: call\ncall: %json {json.dumps(self.call_schema(functions))}"


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json())}


def tool_format(template_source: str | None) -> ToolFormat | None:
    """The tool-call format a chat template teaches (None: it teaches none)."""
    if not template_source:
        return None
    if Hermes.OPEN in template_source:
        return FORMATS["hermes"]
    if Llama3Json.TAG in template_source or "ipython" in template_source:
        return FORMATS["llama3_json"]
    return None

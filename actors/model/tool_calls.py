"""Tool calls in a model's output (issue 38): the format its chat template teaches it, how a
call reads back out of the text, and the grammar that forces one.

Two formats, each chosen by what the chat template writes (:func:`tool_format`), as vLLM's
``hermes`` and ``llama3_json`` parsers read them:

- ``hermes`` (Hermes, Qwen 2.5 and 3, and every template that writes ``<tool_call>``): each
  call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, after any text.
- ``llama3_json`` (Llama 3.1 and later: templates that write ``<|python_tag|>`` or speak
  of ``ipython``): the whole answer is ``{"name": ..., "parameters": {...}}`` (optionally
  after ``<|python_tag|>``; several joined by ``;``).

A template that writes neither has no tool-call format: the front end then refuses tools
unless ``tool_choice`` is ``none``. ``required`` and a named function are enforced by a
grammar (:meth:`ToolFormat.grammar`, a Lark grammar embedding each function's JSON schema,
compact), so such an answer is always a call.

Pure: no torch, no I/O.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

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

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def may_start(self, text: str) -> bool:
        """Whether ``text`` (an answer so far) may already be inside a call: a stream holds
        its text back from then on, to send the calls whole."""
        raise NotImplementedError

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


def _call(obj: object, key: str) -> ToolCall | None:
    """The call an object of the output describes, or None if it is no call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(key, obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(name=obj["name"], arguments=json.dumps(arguments, ensure_ascii=False))


class Hermes(ToolFormat):
    name = "hermes"
    arguments_key = "arguments"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> Parsed:
        start = text.find(self.OPEN)
        if start < 0:
            return Parsed(content=text, calls=())
        calls = []
        for body in self._CALL.findall(text[start:]):
            try:
                call = _call(json.loads(body), self.arguments_key)
            except ValueError:
                call = None
            if call is None:  # not a call after all: the answer is text
                return Parsed(content=text, calls=())
            calls.append(call)
        content = text[:start].strip()
        return Parsed(content=content or None, calls=tuple(calls))

    def may_start(self, text: str) -> bool:
        if self.OPEN in text:
            return True
        tail = text[-len(self.OPEN) + 1 :]  # the opening tag may be arriving
        return any(self.OPEN.startswith(tail[i:]) for i in range(len(tail)) if tail[i:])

    def grammar(self, functions: Sequence[Function]) -> str:
        schema = json.dumps(self.call_schema(functions))
        return f'start: "{self.OPEN}\\n" call "\\n{self.CLOSE}"\ncall: %json {schema}'


class Llama3Json(ToolFormat):
    name = "llama3_json"
    arguments_key = "parameters"
    TAG = "<|python_tag|>"

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix(self.TAG).strip()
        if not body.startswith("{"):
            return Parsed(content=text, calls=())
        calls = []
        for part in body.split(";"):
            try:
                call = _call(json.loads(part), self.arguments_key)
            except ValueError:
                call = None
            if call is None:
                return Parsed(content=text, calls=())
            calls.append(call)
        return Parsed(content=None, calls=tuple(calls))

    def may_start(self, text: str) -> bool:
        head = text.lstrip()
        if not head:
            return False
        return head.startswith(("{", self.TAG)) or self.TAG.startswith(head)

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

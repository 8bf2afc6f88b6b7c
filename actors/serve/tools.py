"""A chat request's tools (issues 38 and 49): checked, offered to the chat template, forced
by a grammar where ``tool_choice`` asks for a call, and read back out of each answer.

``tool_choice`` is ``none`` (the tools are shown to the template, no call is read out),
``auto`` (the default with tools: the model may call), ``required`` (it calls one of them)
or a named function (it calls that one). With ``parallel_tool_calls`` false an answer holds
one call at most: what the model writes after its first is dropped.

``auto`` reads calls in the format the model's chat template teaches
(``actors/text/tool_calls.py``). A template that teaches none has no format to read: the
answer is its text, as with ``none``. vLLM refuses ``auto`` unless the server was started
with a ``--tool-call-parser``; here the parser is the template's, and a model without one
answers as it would without tools (the openai SDK's tool loop sends ``auto`` by default).

``required`` and a named function work on any model: they become the request's structured
output (so they cannot be combined with another), a grammar of the template's own call
form where it has one (Hermes, Llama 3 JSON), else vLLM's JSON forms: a list of
``{"name", "arguments"}`` calls for ``required``, the function's arguments for a named one.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ringfence.actors.http.errors import ApiError
from ringfence.actors.serve.api import ChatCompletionRequest, NamedToolChoice
from ringfence.actors.text.grammars import problem
from ringfence.actors.text.tokenizer import Tokenizer
from ringfence.actors.text.tool_calls import (
    JSON_CALLS,
    Function,
    NamedArguments,
    Parsed,
    ToolFormat,
    tool_format,
)
from ringfence.sched.structured import StructuredOutput


@dataclass(frozen=True, slots=True)
class ToolUse:
    """How one chat request uses its tools."""

    # None: no call is read out (tool_choice none; auto where the template teaches no format)
    format: ToolFormat | None
    tools: tuple[dict[str, Any], ...]  # as the template sees them (OpenAI's tool objects)
    forced: StructuredOutput | None  # the grammar of one call (required, named)
    most: int | None = None  # the calls read out (parallel_tool_calls false: 1; None: all)

    def parse(self, text: str) -> Parsed:
        """The answer's content and calls (every text is content without a format)."""
        if self.format is None:
            return Parsed(content=text, calls=())
        return self.format.parse(text, self.most)


def tool_use(body: ChatCompletionRequest, template_source: str | None) -> ToolUse | None:
    """The request's tool use, or None without tools; ApiError 400 naming the field."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise ApiError(f"tool_choice: {_said(choice)} needs tools", param="tool_choice")
        return None
    functions = [
        Function(name=t.function.name, parameters=t.function.parameters or {}) for t in body.tools
    ]
    names = [f.name for f in functions]
    if len(set(names)) < len(names):
        raise ApiError("tools: two functions have the same name", param="tools")
    tools = tuple(t.model_dump(exclude_none=True) for t in body.tools)
    if choice == "none":
        return ToolUse(format=None, tools=tools, forced=None)
    fmt = tool_format(template_source)
    forced = None
    most = 1 if body.parallel_tool_calls is False else None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            field = "tool_choice.function.name"
            said = f"{choice.function.name!r} is not one of the tools ({', '.join(names)})"
            raise ApiError(f"{field}: {said}", param=field)
        functions = [f for f in functions if f.name == choice.function.name]
    if choice == "required" or isinstance(choice, NamedToolChoice):
        for i, f in enumerate(body.tools):  # each schema's fault named where it is
            if f.function.name in {g.name for g in functions} and f.function.parameters:
                spec = StructuredOutput.json_schema(f.function.parameters)
                if said := problem(spec):
                    field = f"tools.{i}.function.parameters"
                    raise ApiError(f"{field}: {said}", param=field)
        source = fmt.grammar(functions, most) if fmt is not None else None
        if source is None:  # the template has no call form of its own: vLLM's JSON forms
            json_form = (
                NamedArguments(choice.function.name)
                if isinstance(choice, NamedToolChoice)
                else JSON_CALLS
            )
            fmt, source = json_form, json_form.grammar(functions, most)
        forced = StructuredOutput(kind="grammar", source=source)
        if said := problem(forced):
            raise ApiError(f"tool_choice: the call's grammar does not compile: {said}",
                           param="tool_choice")  # fmt: skip
    return ToolUse(format=fmt, tools=tools, forced=forced, most=most)


def answer_decoder(tokenizer: Tokenizer, use: ToolUse | None) -> Callable[[Iterable[int]], str]:
    """How an answer's tokens become its text: special tokens skipped, as always, but for
    the one the tool format's reader must see (Mistral's ``[TOOL_CALLS]``), written as its
    text where the vocabulary holds it as one token (vLLM keeps every special token of a
    tool request for the same reader)."""
    keep = use.format.keep if use is not None and use.format is not None else None
    ids = tokenizer.encode(keep) if keep else []
    if keep is None or len(ids) != 1:  # no such token: its text is the plain text already
        return tokenizer.decode
    [kept] = ids

    def decode(token_ids: Iterable[int]) -> str:
        pieces: list[str] = []
        run: list[int] = []
        for token in token_ids:
            if token == kept:
                pieces += [tokenizer.decode(run), keep]
                run = []
            else:
                run.append(token)
        return "".join([*pieces, tokenizer.decode(run)])

    return decode


def _said(choice: object) -> str:
    return repr(choice) if isinstance(choice, str) else "a named function"


def call_id() -> str:
    """A fresh tool call id, as OpenAI's look."""
    return f"call_{uuid.uuid4().hex[:24]}"


def message_fields(parsed: Parsed) -> dict[str, Any]:
    """The assistant message's ``content`` and (when it called) ``tool_calls``."""
    fields: dict[str, Any] = {"content": parsed.content}
    if parsed.calls:
        fields["tool_calls"] = [
            {"id": call_id(), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.calls
        ]  # fmt: skip
    return fields


class ToolStream:
    """One streamed choice's text while calls may come: content as it is sure to be
    content, each call's start (its id and function's name) as soon as its head is read,
    then its arguments piece by piece as the model writes them, all as ``tool_calls``
    deltas that add up to the whole answer's message (one reader reads both)."""

    def __init__(self, use: ToolUse) -> None:
        self.reader = use.format.reader(use.most) if use.format is not None else None
        self.called = False  # a call has started: the answer finishes as tool_calls

    def take(self, text: str, last: bool) -> list[dict[str, Any]]:
        """The delta objects to send for ``text`` (the choice's next text; ``last``: its
        final piece), in order; none while what it read is undecided."""
        if self.reader is None:
            return [{"content": text}] if text else []
        deltas: list[dict[str, Any]] = []
        for event in self.reader.feed(text, last):
            if event.kind == "content":
                deltas.append({"content": event.text})
                continue
            if event.kind == "call":
                self.called = True
                call = {"index": event.index, "id": call_id(), "type": "function",
                        "function": {"name": event.text, "arguments": ""}}  # fmt: skip
            elif deltas and deltas[-1].get("tool_calls", [{}])[0].get("index") == event.index:
                deltas[-1]["tool_calls"][0]["function"]["arguments"] += event.text
                continue  # one delta per call and piece of text
            else:
                call = {"index": event.index, "function": {"arguments": event.text}}
            deltas.append({"tool_calls": [call]})
        return deltas

"""Tool calls written as a Python list of calls (Llama 3.2's pythonic template, Llama 4):
``[get_weather(city="Rome", days=2), get_time()]``, optionally between ``<|python_start|>``
and ``<|python_end|>``.

The list is read with :mod:`ast` (never evaluated): each element must be a call of a plain
name with keyword arguments whose values are literals (``ast.literal_eval``), written back
as a JSON object. The calls start the answer or there are none: an answer whose first
character (past whitespace and the tag) is not ``[`` is content as written. A list is held
until it closes, so a stream sends each call whole (its name, then its arguments at once)
as soon as its list parses; one that never closes, or is not a list of calls, is content.

Pure: no torch, no I/O.
"""

from __future__ import annotations

import ast
import enum
import json

from ringfence.actors.text.call_reader import Event

START, END = "<|python_start|>", "<|python_end|>"
SPACE = " \t\r\n"


def calls_of(text: str) -> list[tuple[str, str]] | None:
    """The (name, JSON arguments) of each call of the list ``text``, or None when ``text``
    is not a whole list of calls with literal keyword arguments."""
    try:
        tree = ast.parse(text.strip(SPACE), mode="eval")
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree.body, ast.List):
        return None
    calls = []
    for element in tree.body.elts:
        if not isinstance(element, ast.Call) or not isinstance(element.func, ast.Name):
            return None
        if element.args or any(k.arg is None for k in element.keywords):
            return None  # positional arguments and **spreads name no parameter
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in element.keywords}
            calls.append((element.func.id, json.dumps(arguments, ensure_ascii=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None  # not a literal, or not a value JSON can carry (a set, bytes)
    return calls


class Stage(enum.Enum):
    """Where a :class:`PythonicReader` stands in the answer."""

    START = "start"  # undecided: the answer may still open a list of calls
    CONTENT = "content"  # not calls: the rest passes through as content
    DONE = "done"  # the calls were read: the rest is dropped


class PythonicReader:
    """One answer's text, fed in order (a :class:`~.call_reader.Reader`). Owned by one
    answer; ``feed`` mutates it. ``most``: the calls taken (None: all)."""

    def __init__(self, most: int | None = None) -> None:
        self.most = most
        self.held = ""  # the answer so far, while it may be a list of calls
        self.stage = Stage.START

    def feed(self, text: str, last: bool = False) -> list[Event]:
        if self.stage is Stage.CONTENT:
            return [Event("content", text)] if text else []
        if self.stage is Stage.DONE:
            return []
        self.held += text
        body = self.held.lstrip(SPACE)
        body = body.removeprefix(START).lstrip(SPACE) if body.startswith(START) else body
        if body and not body.startswith("[") and not START.startswith(body):
            return self._content()
        if body.startswith("["):
            list_text = body.split(END, 1)[0]
            if list_text.rstrip(SPACE).endswith("]") and (calls := calls_of(list_text)):
                self.stage = Stage.DONE
                return [
                    event
                    for index, (name, arguments) in enumerate(calls[: self.most])
                    for event in (Event("call", name, index), Event("arguments", arguments, index))
                ]
        return self._content() if last else []

    def _content(self) -> list[Event]:
        """The held text as content; the rest of the answer passes through."""
        self.stage = Stage.CONTENT
        held, self.held = self.held, ""
        return [Event("content", held)] if held else []

"""An answer's tool calls read as its text grows (issue 38): content, each call's start (its
function's name) and its arguments' JSON text as the model writes it.

One reader serves the stream and the whole answer alike (``ToolFormat.parse`` feeds it the
whole text at once), so a streamed answer's deltas add up to the whole answer's message by
construction. A call starts once its head is read: ``{"name": "<name>", "arguments": ``
(or ``"parameters"``), whitespace free; from there each piece of the arguments' value goes
out as it comes, and the value's end (its brackets balanced, strings and escapes minded)
ends the call's arguments. Like every server's, a call that was cut short (``length``) keeps
the arguments written so far: they may not be valid JSON, as OpenAI's documentation warns.

With ``most`` calls (OpenAI's ``parallel_tool_calls: false`` is one), what follows the last
call the reader takes is dropped, whether more calls or text.

Calls in a JSON list (Mistral's, after its tag; the JSON form that forces calls on any
model) open with the layout's ``lead`` ``[`` and are parted by its ``separator`` ``,``.

A block whose head reads otherwise (keys in another order, say) is held whole and parsed
as JSON when it ends: a call (its arguments re-serialized) or, when it is none, content.

Whitespace next to a call is not content: a run of it is held until what follows decides
(a call drops it, other text sends it), and at the answer's end it is sent only when the
answer called nothing, so an answer without calls reads back exactly as written.

Pure: no torch, no I/O.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Protocol

Kind = Literal["content", "call", "arguments"]
NEED = "need"  # the text so far may still become what is looked for


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """Where a format's calls sit in an answer."""

    open: str | None  # the tag before each call (Hermes); None: calls start the answer
    close: str | None  # the tag after each call
    lead: str | None  # an optional tag before the first call when calls start the answer
    separator: str | None  # between calls that start the answer (Llama 3: ";")
    keys: tuple[str, ...] = ("arguments", "parameters")  # the arguments' key


@dataclass(frozen=True, slots=True)
class Event:
    """What the text read so far adds: content, a call's start (``text`` its function's
    name) or a piece of a call's arguments."""

    kind: Kind
    text: str
    index: int = 0  # the call's place among the answer's calls (calls and arguments)


class Reader(Protocol):
    """One answer's text read as it grows (a :class:`CallReader`, or a form of its own)."""

    def feed(self, text: str, last: bool = False) -> list[Event]:
        """The events ``text`` (the answer's next piece; ``last``: its final one) adds."""
        ...


def head(text: str, keys: tuple[str, ...]) -> tuple[int, str] | str | None:
    """Where a call's arguments start in ``text`` and its function's name; NEED while
    ``text`` may still become such a head; None when it cannot."""
    p = 0

    def skip() -> None:
        nonlocal p
        while p < len(text) and text[p] in " \t\r\n":
            p += 1

    def take(*words: str) -> str | None:
        nonlocal p
        rest = text[p:]
        for word in words:
            if rest.startswith(word):
                p += len(word)
                return word
        return NEED if any(word.startswith(rest) for word in words) else None

    steps: tuple[tuple[str, ...], ...] = (("{",), ('"name"',), (":",))
    for words in steps:
        skip()
        if (got := take(*words)) in (None, NEED):
            return got
    skip()
    if p == len(text):
        return NEED
    if text[p] != '"':
        return None
    end = _string_end(text, p)
    if end is None:
        return NEED
    try:
        name = json.loads(text[p:end])
    except ValueError:
        return None
    p = end
    steps = ((",",), tuple(f'"{k}"' for k in keys), (":",))
    for words in steps:
        skip()
        if (got := take(*words)) in (None, NEED):
            return got
    skip()
    return (p, name) if p < len(text) else NEED


def _string_end(text: str, start: int) -> int | None:
    """Just past the JSON string that opens at ``start``; None when it has not ended."""
    escaped = False
    for i in range(start + 1, len(text)):
        c = text[i]
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == '"':
            return i + 1
    return None


class _Value:
    """Where one JSON value ends, read piece by piece (its first character first)."""

    def __init__(self) -> None:
        self.depth = 0
        self.started = self.scalar = self.in_string = self.escaped = False

    def end(self, text: str) -> int | None:
        """Just past the value's end in ``text`` (the value's next piece); None: all of it
        belongs to the value."""
        for i, c in enumerate(text):
            if not self.started:
                self.started = True
                self.depth = 1 if c in "{[" else 0
                self.in_string, self.scalar = c == '"', c not in '{["'
            elif self.scalar:
                if c in ",}] \t\r\n;<":
                    return i
            elif self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


def _partial_suffix(text: str, word: str) -> int:
    """The length of ``text``'s longest ending that is a proper beginning of ``word``."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if word.startswith(text[-n:]):
            return n
    return 0


def as_call(body: str) -> tuple[str, str] | None:
    """A call object's name and arguments (re-serialized), or None if ``body`` is none."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class Mode(enum.Enum):
    """Where a :class:`CallReader` stands in the answer; each has one step (:data:`STEPS`)."""

    TEXT = "text"  # content; a call starts at the layout's open tag
    START = "start"  # calls start the answer: before the first
    PLAIN = "plain"  # calls start the answer and it did not: all of it is content
    HEAD = "head"  # a call's head, up to its arguments' first character
    ARGUMENTS = "arguments"  # a call's arguments, sent as they come
    TAIL = "tail"  # after a call's arguments, to its end
    WHOLE = "whole"  # a block whose head reads otherwise, held to its end
    DONE = "done"  # ``most`` calls read: the rest is dropped


# A mode's step: True when it used some of the buffer and another step may follow.
Step = Callable[["CallReader", list[Event], bool], bool]


class CallReader:
    """One answer's text, fed in order: the events each piece adds (see the module
    docstring). It moves between the modes of :class:`Mode`, each read by its step in
    :data:`STEPS`. Owned by one request's answer; ``feed`` mutates it."""

    def __init__(self, layout: Layout, most: int | None = None) -> None:
        self.layout = layout
        self.most = most  # the calls taken (None: all)
        self.mode = Mode.TEXT if layout.open is not None else Mode.START
        self.buffer = ""  # read, not yet decided
        self.spaces = ""  # whitespace held before what may be a call
        self.held = ""  # everything held since the answer's start (calls start the answer)
        self.opening = ""  # between a tag and its list's first head: content if no call
        self.calls = 0
        self.value = _Value()

    def feed(self, text: str, last: bool = False) -> list[Event]:
        """The events ``text`` (the answer's next piece; ``last``: its final one) adds."""
        self.buffer += text
        if self.layout.open is None:
            self.held += text
        events: list[Event] = []
        while self._step(events, last):
            pass
        if last:
            self._finish(events)
        return events

    def _step(self, events: list[Event], last: bool) -> bool:
        ending = last and self.mode in (Mode.HEAD, Mode.WHOLE)  # a block cut short ends here
        return (bool(self.buffer) or ending) and STEPS[self.mode](self, events, last)

    def _text(self, events: list[Event], last: bool) -> bool:
        tag = self.layout.open
        assert tag is not None
        at = self.buffer.find(tag)
        hold = 0 if last else _partial_suffix(self.buffer, tag)  # the tag may be arriving
        cut = at if at >= 0 else len(self.buffer) - hold
        self._content(self.buffer[:cut], events)
        self.buffer = self.buffer[cut:]
        if at < 0:
            return False
        after = Mode.START if self.layout.lead else Mode.HEAD  # a list of calls opens first
        self.buffer, self.mode = self.buffer[len(tag) :], after
        return True

    def _content(self, text: str, events: list[Event]) -> None:
        """Sends ``text`` as content, its trailing whitespace held."""
        said = text.rstrip(" \t\r\n")
        if said:
            events.append(Event("content", self.spaces + said))
            self.spaces = ""
        self.spaces += text[len(said) :]

    def _start(self, events: list[Event], last: bool) -> bool:
        lead = self.layout.lead or ""
        rest = self.buffer.lstrip(" \t\r\n")
        if lead and rest.startswith(lead):
            rest = rest[len(lead) :].lstrip(" \t\r\n")
        elif lead and lead.startswith(rest) and not last:
            return False
        if not rest:
            return False
        if rest.startswith("{"):
            self.opening = self.buffer[: len(self.buffer) - len(rest)]
            self.buffer, self.mode = rest, Mode.HEAD
        elif self.layout.open is not None:  # not calls after the tag: held whole, content
            self.mode = Mode.WHOLE
        else:
            self.mode, self.buffer = Mode.PLAIN, self.held
        return True

    def _plain(self, events: list[Event], last: bool) -> bool:
        if self.buffer:
            events.append(Event("content", self.buffer))
        self.buffer = ""
        return False

    def _head(self, events: list[Event], last: bool) -> bool:
        got = head(self.buffer, self.layout.keys)
        if got == NEED and not last:
            return False
        if not isinstance(got, tuple):
            self.mode = Mode.WHOLE
            return True
        start, name = got
        self.spaces = self.opening = ""
        events.append(Event("call", name, self.calls))
        self.buffer, self.mode, self.value = self.buffer[start:], Mode.ARGUMENTS, _Value()
        return True

    def _arguments(self, events: list[Event], last: bool) -> bool:
        close = self.layout.close or ""
        text, used, done = self.buffer, 0, False
        while not done:  # a call closed before its arguments did ends them there
            rest = text[used:]
            at = rest.find(close) if close else -1
            hold = 0 if last or not close else _partial_suffix(rest, close)
            scan = rest[:at] if at >= 0 else rest[: len(rest) - hold]
            end = self.value.end(scan)
            used += len(scan) if end is None else end
            if end is not None or at < 0:
                done = end is not None
                break
            if not self.value.in_string:
                done = True
            else:  # the tag is a string's text: the arguments' own
                self.value.end(close)
                used += len(close)
        if used:
            events.append(Event("arguments", text[:used], self.calls))
        self.buffer = text[used:]
        if not done:
            return False
        self.calls += 1
        self.mode = Mode.DONE if self.calls == self.most else Mode.TAIL
        return True

    def _tail(self, events: list[Event], last: bool) -> bool:
        end = self.layout.close or self.layout.separator or ""
        at = self.buffer.find(end) if end else -1
        if at < 0:  # the rest of the call (its closing brace) is no content
            keep = 0 if last else _partial_suffix(self.buffer, end) if end else 0
            self.buffer = self.buffer[len(self.buffer) - keep :]
            return False
        self.buffer = self.buffer[at + len(end) :]
        # Past a call's closing tag comes text; past a separator, the next call.
        self.mode = Mode.TEXT if self.layout.close is not None else Mode.HEAD
        return True

    def _whole(self, events: list[Event], last: bool) -> bool:
        close = self.layout.close
        at = self.buffer.find(close) if close is not None else -1
        if at < 0 and not last:
            return False
        body = self.buffer if at < 0 else self.buffer[:at]
        after = len(self.buffer) if at < 0 else at + len(close or "")
        calls = self._calls_of(body)
        if calls is not None:
            for name, arguments in calls[: self._room()]:
                events.append(Event("call", name, self.calls))
                events.append(Event("arguments", arguments, self.calls))
                self.calls += 1
            self.spaces = ""
        elif self.layout.open is not None:  # not a call after all: the block is content
            self._content(self.layout.open + self.opening + self.buffer[:after], events)
        elif content := self.held if not self.calls else body.strip(" \t\r\n"):
            events.append(Event("content", content))
        self.buffer = self.buffer[after:]
        if self.calls == self.most:
            self.mode = Mode.DONE
        else:
            self.mode = Mode.TEXT if self.layout.open is not None else Mode.PLAIN
        return True

    def _calls_of(self, body: str) -> list[tuple[str, str]] | None:
        """The calls a block held whole holds, or None when it is not all calls."""
        if self.layout.lead == "[":  # calls in a JSON list, its bracket read or not
            text = body.strip(" \t\r\n")
            try:
                items = json.loads(text if text.startswith("[") else "[" + text)
            except ValueError:
                return None
            parts = [json.dumps(i) for i in items] if isinstance(items, list) else [""]
        else:
            parts = body.split(self.layout.separator) if self.layout.separator else [body]
        calls = [as_call(part) for part in parts]
        return [c for c in calls if c is not None] if calls and all(calls) else None

    def _done(self, events: list[Event], last: bool) -> bool:
        self.buffer = ""
        return False

    def _room(self) -> int | None:
        """How many more calls the reader takes (None: any)."""
        return None if self.most is None else self.most - self.calls

    def _finish(self, events: list[Event]) -> None:
        if self.mode == Mode.START and self.layout.open is not None:  # a tag, then no list
            self._content(self.layout.open + self.buffer, events)
        elif self.mode == Mode.START and self.held:
            events.append(Event("content", self.held))
        if self.spaces and not self.calls:
            events.append(Event("content", self.spaces))
        self.buffer = self.spaces = ""


def _steps(table: Mapping[Mode, Step]) -> Mapping[Mode, Step]:
    """``table``, read-only; TypeError naming each mode it has no step for."""
    if missing := [mode.name for mode in Mode if mode not in table]:
        raise TypeError(f"CallReader: no step for the modes {missing}")
    return MappingProxyType(dict(table))


# Each mode's step, checked once, at import: a mode without one is a TypeError then.
STEPS: Mapping[Mode, Step] = _steps({
    Mode.TEXT: CallReader._text,
    Mode.START: CallReader._start,
    Mode.PLAIN: CallReader._plain,
    Mode.HEAD: CallReader._head,
    Mode.ARGUMENTS: CallReader._arguments,
    Mode.TAIL: CallReader._tail,
    Mode.WHOLE: CallReader._whole,
    Mode.DONE: CallReader._done,
})  # fmt: skip

"""Output text of a request as its tokens arrive: incremental detokenization and stop strings.

A request's tokens arrive a few at a time; the text a client sees must be the text of all
of them, never a character cut in half. :class:`TextStream` decodes the tokens since the
last complete character and holds back what ends in U+FFFD (a byte-level token that
starts a character the next token finishes), and what could still be the beginning of a
stop string. A stop string ends the text before it (it is not part of the output, as in
the OpenAI API), and the request (the caller aborts it in the engine).

Which tokens made the text released so far is kept too (:meth:`TextStream.tokens_released`):
a request's log probabilities follow its text, so a stop string's tokens, cut from the
text, are cut from them as well.

Owned by one request's coroutine; not thread-safe. Decoding a window rather than the
whole output keeps the cost per token constant.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence

REPLACEMENT = "\ufffd"  # what a decoder gives for bytes that are not yet a whole character

Decode = Callable[[Iterable[int]], str]


class TextStream:
    """The text of one request's output tokens, released as it becomes final."""

    def __init__(self, decode: Decode, stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1  # chars kept back
        self.token_ids: list[int] = []  # every token so far
        self._prefix = 0  # tokens before this index are decoded into self._text for good
        self._read = 0  # tokens before this index are in self._text
        self._text = ""  # the text of token_ids[:_read]
        self._released = 0  # characters of self._text handed out
        self.stopped = False  # a stop string was found: no more text, ever
        # (tokens, characters) at each point where decoding reached a whole character: the
        # text of token_ids[:tokens] is self._text[:characters]. A window of tokens that
        # makes one character together (byte-level pieces) has no point inside it.
        self._bounds: list[tuple[int, int]] = [(0, 0)]

    def add(self, token_ids: Iterable[int]) -> str:
        """Take new tokens; the text that became final (may be empty)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        before = self._decode(self.token_ids[self._prefix : self._read])
        after = self._decode(self.token_ids[self._prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            if self._stop:
                self._bound_each(before, after)
            self._text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.token_ids)
            self._bounds.append((self._read, len(self._text)))
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended: the rest of its text (an incomplete character as U+FFFD)."""
        if not self.stopped and self._read < len(self.token_ids):
            before = self._decode(self.token_ids[self._prefix : self._read])
            self._text += self._decode(self.token_ids[self._prefix :])[len(before) :]
            self._read = len(self.token_ids)
            self._bounds.append((self._read, len(self._text)))
        return self._release(final=True)

    def _bound_each(self, before: str, after: str) -> None:
        """The points inside the window about to be taken (tokens ``_read`` on) where its
        text so far is a prefix of the window's, ``after`` (a character still incomplete
        there decodes otherwise; bytes of no character, as U+FFFD in both): under stop
        strings, text released partway through a window must name its tokens (one decode
        each)."""
        base, last = len(self._text) - len(before), self._bounds[-1][1]
        for end in range(self._read + 1, len(self.token_ids)):
            piece = self._decode(self.token_ids[self._prefix : end])
            chars = base + len(piece)
            if chars > last and after.startswith(piece):
                self._bounds.append((end, chars))
                last = chars

    @property
    def text(self) -> str:
        """Everything released so far."""
        return self._text[: self._released]

    def tokens_released(self) -> int:
        """How many of the first tokens made the text released so far: before a stop, the
        tokens whose text is wholly released; after a stop string, the tokens whose text
        begins before it (a token that ends inside the stop string made text the client
        got, and stays), never one of the stop string's own."""
        bounds, released = self._bounds, self._released
        if not self.stopped:
            return bounds[bisect_right(bounds, released, key=_chars) - 1][0]
        at = bisect_left(bounds, released, key=_chars)
        return bounds[at][0] if at < len(bounds) else len(self.token_ids)

    def _release(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        # A stop string may start in text already released only if it is longer than what
        # was held back, and held-back text is exactly what a stop string could start in.
        start = max(0, self._released - self._hold)
        found = [i for i in (self._text.find(s, start) for s in self._stop) if i >= 0]
        if found:
            end = min(found)
            self.stopped = True
            self._text = self._text[:end]
        else:
            end = len(self._text) if final else max(self._released, len(self._text) - self._hold)
        out = self._text[self._released : end]
        self._released = end
        return out


def _chars(bound: tuple[int, int]) -> int:
    return bound[1]

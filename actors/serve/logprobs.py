"""The engine's log probabilities in the API's three shapes, as vLLM answers them.

- :func:`completion_logprobs`: the legacy object of ``/v1/completions`` (``tokens``,
  ``token_logprobs``, ``top_logprobs``, ``text_offset``), prompt entries (``echo``) first;
  a prompt's first token has none (``null``, as in vLLM).
- :func:`chat_logprobs`: the ``content`` list of ``/v1/chat/completions``.
- :func:`prompt_logprobs`: vLLM's ``prompt_logprobs`` field (``null`` first, then
  ``{token id: {logprob, rank, decoded_token}}`` per prompt token).

A token is shown as its own text; a token that is part of a character (a byte-level
token that starts or continues a multi-byte UTF-8 sequence) as ``bytes:\\xNN...``, vLLM's
rendering, so that distinct tokens keep distinct keys. Pure functions; any thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ringfence.actors.text.tokenizer import NUM_BYTES, ByteTokenizer, Tokenizer
from ringfence.sched.sampling import LOGPROB_FLOOR, TokenLogprobs

REPLACEMENT = "\ufffd"


class TokenNames:
    """Each token id's text and bytes, for one tokenizer (memoized: a vocabulary is fixed)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._bytes = isinstance(tokenizer, ByteTokenizer)
        self._names: dict[int, str] = {}

    def raw(self, token_id: int) -> bytes:
        """The token's UTF-8 bytes (a byte tokenizer's byte; else its text's encoding)."""
        if self._bytes:
            return bytes([token_id]) if token_id < NUM_BYTES else b""
        return self._tokenizer.decode([token_id]).encode("utf-8", errors="replace")

    def text(self, token_id: int) -> str:
        """The token as text; ``bytes:\\xNN...`` for a part of a character."""
        name = self._names.get(token_id)
        if name is None:
            name = self._tokenizer.decode([token_id])
            if REPLACEMENT in name:
                raw = self.raw(token_id)
                if raw.decode("utf-8", errors="replace") != raw.decode("utf-8", "ignore"):
                    name = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            self._names[token_id] = name
        return name


def _value(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def completion_logprobs(
    entries: Sequence[tuple[int, TokenLogprobs | None]], names: TokenNames, k: int,
    offset: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """The legacy object for ``entries``: (token id, its log probabilities; None for a
    token without any, the prompt's first), each with the sampled token and its ``k`` best
    alternatives; text offsets from ``offset``, each token counted by the length of its
    text as shown (vLLM's count)."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in entries:
        token = names.text(token_id)
        offsets.append(offset)
        offset += len(token)
        tokens.append(token)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(_value(entry.logprob))
        top = {token: _value(entry.logprob)}
        for other, logprob in entry.top[:k]:
            top.setdefault(names.text(other), _value(logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def chat_logprobs(
    entries: Sequence[TokenLogprobs], names: TokenNames, k: int
) -> list[dict[str, Any]]:
    """The chat ``content`` items: each token and its ``k`` most probable tokens."""
    return [
        {
            **_chat_token(entry.token_id, entry.logprob, names),
            "top_logprobs": [_chat_token(t, lp, names) for t, lp in entry.top[:k]],
        }
        for entry in entries
    ]


def _chat_token(token_id: int, logprob: float, names: TokenNames) -> dict[str, Any]:
    return {"token": names.text(token_id), "logprob": _value(logprob),
            "bytes": list(names.raw(token_id))}  # fmt: skip


def prompt_logprobs(
    entries: Sequence[TokenLogprobs], names: TokenNames, k: int
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs``: None for the first token, then per token its own entry
    and its ``k`` best alternatives, keyed by token id (a string, as JSON's keys are)."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for entry in entries:
        row = {str(entry.token_id): _vllm_entry(entry.token_id, entry.logprob, entry.rank, names)}
        for rank, (token_id, logprob) in enumerate(entry.top[:k], start=1):
            row.setdefault(str(token_id), _vllm_entry(token_id, logprob, rank, names))
        out.append(row)
    return out


def _vllm_entry(token_id: int, logprob: float, rank: int, names: TokenNames) -> dict[str, Any]:
    return {"logprob": _value(logprob), "rank": rank, "decoded_token": names.text(token_id)}

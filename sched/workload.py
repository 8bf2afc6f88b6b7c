"""Workload files: the requests of a workload, parsed from JSON lines, and its returning turns.

A workload line is one JSON object with ``id``, exactly one of ``prompt`` (text),
``prompt_token_ids`` and ``messages`` (a chat: a list of objects with string ``role``
and ``content``, rendered through the model's chat template by the engine), and optional
``arrival_s``, ``session`` and any field of ``SamplingParams`` (``max_tokens``,
``temperature``, ``top_p``, ``seed``, ``stop_token_ids``, ``logprobs``...) (docs/design.md,
"Run dirs and workload files"). Parsing takes the lines
the caller read: this package does no I/O. The built-in workloads are synthetic.py's.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ringfence.sched.checks import RequestError, check_number, check_token_ids
from ringfence.sched.request import check_messages
from ringfence.sched.sampling import SAMPLING_KEYS, SamplingParams
from ringfence.shm.errors import RingfenceError

_PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")  # a line gives exactly one
KEYS = ("id", *_PROMPT_KEYS, *SAMPLING_KEYS, "arrival_s", "session")


class WorkloadError(RingfenceError, ValueError):
    """A workload line, or a synthetic workload's name or size, is invalid.

    The message starts with ``source:line``; ``line`` and ``key`` name what was
    wrong when known.
    """

    def __init__(self, message: str, *, line: int | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.line = line
        self.key = key


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkloadRequest:
    """One request of a workload, before tokenization (for a text prompt) and admission."""

    id: str  # unique within the workload
    # Exactly one of prompt_token_ids, prompt and messages is not None.
    prompt_token_ids: tuple[int, ...] | None
    prompt: str | None  # text for the tokenizer
    params: SamplingParams
    arrival_s: float = 0.0  # seconds after the workload starts
    # A chat for the model's chat template: objects with string role and content (and any
    # other keys the template reads), as the line gave them.
    messages: tuple[dict[str, Any], ...] | None = None
    session: str = ""  # the conversation it belongs to; empty: none (see returning_turns)

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id:
            raise RequestError(f"id must be a non-empty string, got {self.id!r}", field="id")
        given = [self.prompt, self.prompt_token_ids, self.messages]
        if sum(value is not None for value in given) != 1:
            raise RequestError(
                f"request {self.id!r}: give exactly one of prompt, prompt_token_ids and messages",
                field="prompt",
            )
        if self.messages is not None:
            object.__setattr__(self, "messages", check_messages(self.messages))
        if self.prompt is not None and (not isinstance(self.prompt, str) or not self.prompt):
            raise RequestError(
                f"prompt must be a non-empty string, got {self.prompt!r}", field="prompt"
            )
        if self.prompt_token_ids is not None:
            ids = check_token_ids("prompt_token_ids", self.prompt_token_ids, allow_empty=False)
            object.__setattr__(self, "prompt_token_ids", ids)
        if not isinstance(self.params, SamplingParams):
            raise RequestError(
                f"params must be SamplingParams, got {self.params!r}", field="params"
            )
        object.__setattr__(self, "arrival_s", check_number("arrival_s", self.arrival_s))
        if not isinstance(self.session, str):
            raise RequestError(f"session must be a string, got {self.session!r}", field="session")


def returning_turns(requests: Iterable[WorkloadRequest]) -> frozenset[str]:
    """The ids of the returning turns among ``requests``: those whose prompt extends the
    prompt of a request of the same ``session`` that arrived earlier (or on an earlier
    line at the same time). A request without a session is never a returning turn.

    The workload names the session and the prompt proves the turn: a line that claims a
    session but does not extend its earlier prompt counts as a first turn. Prefix-cache
    hits would be no proof (a first turn hits the shared system prompt; a returning turn
    whose blocks were evicted everywhere misses).
    """
    earlier: dict[str, list[str | tuple[Any, ...]]] = {}
    found: set[str] = set()
    for request in sorted(requests, key=lambda r: r.arrival_s):
        if not request.session:
            continue
        prompt = _prompt_of(request)
        prompts = earlier.setdefault(request.session, [])
        if any(len(p) < len(prompt) and prompt[: len(p)] == p for p in prompts):
            found.add(request.id)
        prompts.append(prompt)
    return frozenset(found)


def _prompt_of(request: WorkloadRequest) -> str | tuple[Any, ...]:
    """What a returning turn extends: the text, the token ids, or the chat's messages."""
    if request.prompt is not None:
        return request.prompt
    if request.prompt_token_ids is not None:
        return tuple(request.prompt_token_ids)
    return tuple(request.messages or ())


def parse_workload(
    lines: Iterable[str | bytes] | str | bytes, *, source: str = "<workload>"
) -> list[WorkloadRequest]:
    """Parse JSON lines into requests sorted by (arrival_s, line order).

    ``lines`` is what the caller read: an iterable of lines, or one str or bytes that
    is split into lines. Blank lines are skipped. The first bad line raises
    WorkloadError naming ``source:line`` and the key.
    """
    if isinstance(lines, str | bytes):
        lines = lines.splitlines()
    requests: list[WorkloadRequest] = []
    first_line: dict[str, int] = {}  # id -> the line that used it first
    for number, raw in enumerate(lines, start=1):
        where = f"{source}:{number}"
        try:
            text = raw.decode() if isinstance(raw, bytes) else raw
        except UnicodeDecodeError as exc:
            raise WorkloadError(f"{where}: not UTF-8: {exc.reason}", line=number) from None
        if not text.strip():
            continue
        request = _parse_line(text, where, number)
        if request.id in first_line:
            raise WorkloadError(
                f"{where}: id: duplicate id {request.id!r} (first used on line "
                f"{first_line[request.id]})",
                line=number,
                key="id",
            )
        first_line[request.id] = number
        requests.append(request)
    # sorted() is stable, so requests arriving together keep their line order.
    return sorted(requests, key=lambda r: r.arrival_s)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise WorkloadError(f"{key}: key given twice", key=key)
        obj[key] = value
    return obj


def _parse_line(text: str, where: str, number: int) -> WorkloadRequest:
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except WorkloadError as exc:
        raise WorkloadError(f"{where}: {exc}", line=number, key=exc.key) from None
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where}: invalid JSON: {exc}", line=number) from None
    except ValueError as exc:  # an integer longer than Python converts (4,300 digits)
        raise WorkloadError(f"{where}: invalid JSON: {exc}", line=number) from None
    except RecursionError:  # arrays or objects nested deeper than the interpreter's stack
        raise WorkloadError(f"{where}: invalid JSON: nested too deeply", line=number) from None
    if not isinstance(obj, dict):
        raise WorkloadError(
            f"{where}: expected a JSON object, got {type(obj).__name__}", line=number
        )
    for key in obj:
        if key not in KEYS:
            close = difflib.get_close_matches(key, KEYS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise WorkloadError(f"{where}: {key}: unknown key{hint}", line=number, key=key)
    if "id" not in obj:
        raise WorkloadError(f"{where}: id: missing", line=number, key="id")
    if sum(key in obj for key in _PROMPT_KEYS) != 1:
        raise WorkloadError(
            f"{where}: prompt: give exactly one of prompt, prompt_token_ids and messages",
            line=number,
            key="prompt",
        )
    try:
        params = SamplingParams(**{k: obj[k] for k in SAMPLING_KEYS if k in obj})
        return WorkloadRequest(
            id=obj["id"],
            prompt=obj.get("prompt"),
            prompt_token_ids=obj.get("prompt_token_ids"),
            messages=obj.get("messages"),
            params=params,
            arrival_s=obj.get("arrival_s", 0.0),
            session=obj.get("session", ""),
        )
    except RequestError as exc:
        # The fields are named as the keys, so the field is the key to point at.
        raise WorkloadError(f"{where}: {exc}", line=number, key=exc.field) from None

"""Workloads: request lists parsed from JSON lines, and built-in synthetic ones.

A workload line is one JSON object with ``id``, exactly one of ``prompt`` (text),
``prompt_token_ids`` and ``messages`` (a chat: a list of objects with string ``role``
and ``content``, rendered through the model's chat template by the engine), and optional
``arrival_s``, ``session`` and any field of ``SamplingParams`` (``max_tokens``,
``temperature``, ``top_p``, ``seed``, ``stop_token_ids``, ``logprobs``...) (docs/design.md,
"Run dirs and workload files"). Parsing takes the lines
the caller read: this package does no I/O. Synthetic workloads are pure functions of their
name, seed and size, with token ids in 0..255, the byte tokenizer's range, so any model of
this project can run them.
"""

from __future__ import annotations

import difflib
import json
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

from ringfence.sched.checks import RequestError, check_number, check_token_ids
from ringfence.sched.request import check_messages
from ringfence.sched.sampling import SAMPLING_KEYS, SamplingParams
from ringfence.shm.errors import RingfenceError

_PROMPT_KEYS = ("prompt", "prompt_token_ids", "messages")  # a line gives exactly one
KEYS = ("id", *_PROMPT_KEYS, *SAMPLING_KEYS, "arrival_s", "session")
VOCAB = 256  # synthetic token ids lie in 0..VOCAB-1


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


# Synthetic workloads


class _Synthetic(NamedTuple):
    build: Callable[[random.Random, int], list[WorkloadRequest]]
    default_requests: int


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _distinct_heads(rng: random.Random, count: int) -> list[list[int]]:
    """``count`` distinct token prefixes, as short as can be distinct (1 token up to 256).

    Starting each prompt with its own head guarantees that no two prompts share a
    prefix as long as the head, whatever the random tokens after it.
    """
    width = 1
    while VOCAB**width < count:
        width += 1
    picks = rng.sample(range(VOCAB**width), count)
    return [[(p // VOCAB**i) % VOCAB for i in reversed(range(width))] for p in picks]


MULTITURN_SYSTEM_TOKENS = 256
MULTITURN_TURNS = 4


def _multiturn(rng: random.Random, num_requests: int) -> list[WorkloadRequest]:
    """Chats of 4 turns behind one shared 256-token system prompt (default 24 requests).

    Turn 1's prompt is the system prompt and a user message (24-48 tokens); turn
    k+1's prompt is turn k's prompt, a stand-in for its answer (24-48 tokens) and a
    new user message, so every turn extends the previous one and the fourth is at
    most 256 + 7 * 48 = 592 tokens. max_tokens 16-32. Chat c starts at 0.25 c
    seconds and its turns come 2 s apart, in order. The last chat is cut short when
    ``requests`` is not a multiple of 4.
    """
    system = _tokens(rng, MULTITURN_SYSTEM_TOKENS)
    num_chats = -(-num_requests // MULTITURN_TURNS)
    out: list[WorkloadRequest] = []
    for chat in range(num_chats):
        prompt = system + _tokens(rng, rng.randint(24, 48))
        for turn in range(MULTITURN_TURNS):
            if len(out) == num_requests:
                break
            if turn:
                prompt = (
                    prompt + _tokens(rng, rng.randint(24, 48)) + _tokens(rng, rng.randint(24, 48))
                )
            out.append(
                WorkloadRequest(
                    id=f"multiturn-c{chat}-t{turn}",
                    prompt_token_ids=tuple(prompt),
                    prompt=None,
                    params=SamplingParams(max_tokens=rng.randint(16, 32), seed=len(out)),
                    arrival_s=0.25 * chat + 2.0 * turn,
                    session=f"multiturn-c{chat}",
                )
            )
    return sorted(out, key=lambda r: r.arrival_s)


def _unique(rng: random.Random, num_requests: int) -> list[WorkloadRequest]:
    """Random prompts of 100-300 tokens that share no prefix (default 24 requests).

    Every prompt starts with its own head (one token while requests <= 256), so no
    two share even that: nothing is reusable across requests. max_tokens 16-32;
    arrivals 0-100 ms apart.
    """
    out: list[WorkloadRequest] = []
    arrival_ms = 0
    for index, head in enumerate(_distinct_heads(rng, num_requests)):
        prompt = head + _tokens(rng, rng.randint(100, 300) - len(head))
        out.append(
            WorkloadRequest(
                id=f"unique-{index}",
                prompt_token_ids=tuple(prompt),
                prompt=None,
                params=SamplingParams(max_tokens=rng.randint(16, 32), seed=index),
                arrival_s=arrival_ms / 1000,
            )
        )
        arrival_ms += rng.randint(0, 100)
    return out


PRESSURE_MIN_TOKENS_PER_REQUEST = 300 + 32  # shortest prompt + smallest max_tokens


def _pressure(rng: random.Random, num_requests: int) -> list[WorkloadRequest]:
    """Long prompts (300-500 tokens) and outputs (max_tokens 32-64), all at t=0 (default 32).

    No shared prefixes (each prompt has its own head), so the default's at least
    32 * (300 + 32) = 10,624 tokens need at least 664 blocks of 16 tokens when all
    run at once: more than a 512-block device pool (twice the default), and far more than
    the small pools tests use. Forces preemption or queueing.
    """
    out: list[WorkloadRequest] = []
    for index, head in enumerate(_distinct_heads(rng, num_requests)):
        prompt = head + _tokens(rng, rng.randint(300, 500) - len(head))
        out.append(
            WorkloadRequest(
                id=f"pressure-{index}",
                prompt_token_ids=tuple(prompt),
                prompt=None,
                params=SamplingParams(max_tokens=rng.randint(32, 64), seed=index),
                arrival_s=0.0,
            )
        )
    return out


INTERLEAVED_SHORT = (32, 64)  # tokens of a decoding stream's prompt
INTERLEAVED_DECODE_TOKENS = (96, 128)  # its max_tokens: it decodes while the long ones come
INTERLEAVED_LONG = (768, 1024)  # tokens of a long prompt
INTERLEAVED_LONG_TOKENS = (8, 16)  # its max_tokens
INTERLEAVED_FIRST_S = 0.5  # when the first long prompt arrives
INTERLEAVED_GAP_S = 0.75  # between two long prompts


def _interleaved(rng: random.Random, num_requests: int) -> list[WorkloadRequest]:
    """Long prompts arriving while others decode (default 16).

    A quarter of the requests (at least one) are decoding streams: 32-64-token prompts
    with max_tokens 96-128, all at t=0. The others are long prompts of 768-1,024 tokens
    with max_tokens 8-16, the first at 0.5 s and then one every 0.75 s, so each long
    prompt's prefill lands among the streams' decode steps: where prefill and decode share
    a batch, the streams' inter-token gaps grow by a prefill; where they run on
    different instances (prefill/decode disaggregation), they need not. No two prompts
    share a prefix (each has its own head).
    """
    num_streams = max(1, num_requests // 4)
    out: list[WorkloadRequest] = []
    for index, head in enumerate(_distinct_heads(rng, num_requests)):
        streaming = index < num_streams
        length = rng.randint(*(INTERLEAVED_SHORT if streaming else INTERLEAVED_LONG))
        max_tokens = rng.randint(
            *(INTERLEAVED_DECODE_TOKENS if streaming else INTERLEAVED_LONG_TOKENS)
        )
        arrival = (
            0.0 if streaming else INTERLEAVED_FIRST_S + INTERLEAVED_GAP_S * (index - num_streams)
        )
        out.append(
            WorkloadRequest(
                id=f"{'stream' if streaming else 'long'}-{index}",
                prompt_token_ids=tuple(head + _tokens(rng, length - len(head))),
                prompt=None,
                params=SamplingParams(max_tokens=max_tokens, seed=index),
                arrival_s=arrival,
            )
        )
    return out


CHAT_SYSTEM_TOKENS = 256
CHAT_ROUNDS = 4
CHAT_USERS = 12  # of the default size
CHAT_OPENING = (768, 1024)  # tokens of a user's first message (a pasted document)
CHAT_ANSWER = (96, 160)  # tokens standing in for the answer to a turn
CHAT_QUESTION = (32, 64)  # tokens of each later message
CHAT_MAX_TOKENS = (8, 16)
CHAT_GAP_S = 1.0  # seconds between one user's turn and the next user's


def _chat(rng: random.Random, num_requests: int) -> list[WorkloadRequest]:
    """Long-context chat: 12 users return for 4 rounds behind one system prompt (default 48).

    A user's first turn is the shared 256-token system prompt and an opening message of
    768-1,024 tokens; each later turn is the user's whole history (the previous
    prompt, 96-160 tokens standing in for its answer, and a new 32-64-token question),
    so the fourth turn is at most 2,016 tokens and with max_tokens 8-16 fits 2,048
    positions. Users take turns round-robin, one a second (user u's round r at
    r * users + u seconds): between two turns of a user every other user has had one,
    so together the histories outgrow the device pool and a returning turn finds its
    prefix on host or in storage. Every request names its user as ``session``. A size of
    n requests has ceil(n / 4) users; one that is not a multiple of 4 drops the last
    arrivals.
    """
    system = _tokens(rng, CHAT_SYSTEM_TOKENS)
    num_users = -(-num_requests // CHAT_ROUNDS)
    histories = [
        system + head + _tokens(rng, rng.randint(*CHAT_OPENING) - len(head))
        for head in _distinct_heads(rng, num_users)
    ]
    out: list[WorkloadRequest] = []
    for turn in range(CHAT_ROUNDS):
        for user in range(num_users):
            if turn:
                histories[user] += _tokens(rng, rng.randint(*CHAT_ANSWER))
                histories[user] += _tokens(rng, rng.randint(*CHAT_QUESTION))
            out.append(
                WorkloadRequest(
                    id=f"chat-u{user}-t{turn}",
                    prompt_token_ids=tuple(histories[user]),
                    prompt=None,
                    params=SamplingParams(max_tokens=rng.randint(*CHAT_MAX_TOKENS), seed=len(out)),
                    arrival_s=CHAT_GAP_S * len(out),
                    session=f"chat-u{user}",
                )
            )
    return out[:num_requests]


SYNTHETIC: Mapping[str, _Synthetic] = MappingProxyType(
    {
        "chat": _Synthetic(_chat, CHAT_USERS * CHAT_ROUNDS),
        "multiturn": _Synthetic(_multiturn, 24),
        "unique": _Synthetic(_unique, 24),
        "pressure": _Synthetic(_pressure, 32),
        "interleaved": _Synthetic(_interleaved, 16),
    }
)


def synthetic(name: str, *, seed: int = 0, requests: int | None = None) -> list[WorkloadRequest]:
    """The built-in workload ``name`` (see SYNTHETIC), sorted by arrival.

    The same (name, seed, requests) always gives the same requests; ``requests``
    defaults to the workload's own size.
    """
    spec = SYNTHETIC.get(name)
    if spec is None:
        raise WorkloadError(
            f"unknown synthetic workload {name!r}; known: {', '.join(SYNTHETIC)}", key="name"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise WorkloadError(f"seed must be an int >= 0, got {seed!r}", key="seed")
    if requests is None:
        requests = spec.default_requests
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise WorkloadError(f"requests must be an int >= 1, got {requests!r}", key="requests")
    # A string seed is hashed with SHA-512: stable across runs and Python versions.
    rng = random.Random(f"ringfence.sched.workload:{name}:{seed}")
    return spec.build(rng, requests)


def describe(name: str) -> str:
    """The first line of a synthetic workload's docstring, for help texts."""
    doc = SYNTHETIC[name].build.__doc__ or ""
    return doc.strip().splitlines()[0] if doc else name

"""Synthetic workloads: the built-in request lists, pure functions of name, seed and size.

Their token ids lie in 0..255, the byte tokenizer's range, so any model of this project
can run them. ``ringfence launch --workload synthetic:NAME`` runs one (docs/design.md,
"Run dirs and workload files").
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import NamedTuple

from ringfence.sched.sampling import SamplingParams
from ringfence.sched.workload import WorkloadError, WorkloadRequest

VOCAB = 256  # synthetic token ids lie in 0..VOCAB-1


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
    # A string seed is hashed with SHA-512: stable across runs and Python versions. It names
    # the module these lived in before synthetic.py, so every (name, seed) keeps its requests.
    rng = random.Random(f"ringfence.sched.workload:{name}:{seed}")
    return spec.build(rng, requests)


def describe(name: str) -> str:
    """The first line of a synthetic workload's docstring, for help texts."""
    doc = SYNTHETIC[name].build.__doc__ or ""
    return doc.strip().splitlines()[0] if doc else name

"""The client side of ``ringfence bench router-latency``: its prompts, its request bodies,
and a closed loop that times each request from its send to its answer's last byte.

A closed loop: ``concurrency`` workers on one event loop, each sending its next request as
soon as its last one was answered, so the load is whatever the server sustains, never a
queue the client built. Each worker keeps a connection to each server (:mod:`.http1`: a
bare HTTP/1.1 client, so that the client's own time is small beside the router's). A
request fails when its answer is not 200, its JSON has no choices, its stream ends without
``data: [DONE]``, its connection breaks, or it takes ``TIMEOUT_S``; the loop goes on.

:func:`measure` runs one cell of the report: a warm-up on both sides (not counted), then
rounds, each a slice of the requests sent directly to the instances (in turn) and the same
slice through the router, the side that goes first alternating, so that a drift of the
machine (a neighbour's load, a CPU's clock) falls on both sides alike.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import orjson

from ringfence.actors.tools.bench.serving.http1 import BadAnswer, Connection

PROMPTS: Final = ("ids", "text", "chat")  # how a prompt is sent (see body_of)
PATHS: Final = {"ids": "/v1/completions", "text": "/v1/completions",
                "chat": "/v1/chat/completions"}  # fmt: skip
# Token ids drawn from the bytes of lowercase ASCII letters, so that a prompt sent as text
# is the same ids as the same prompt sent as ids (the stub's tokenizer is UTF-8 bytes).
FIRST_ID, LAST_ID = ord("a"), ord("z")
DONE_TAIL: Final = b"data: [DONE]\n\n"
SIDES: Final = ("direct", "router")
TIMEOUT_S: Final = 30.0  # one request, from its send to its answer's last byte


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """What a cell's requests look like."""

    prompt: str  # "ids", "text" or "chat" (PROMPTS)
    stream: bool  # server-sent events, else one JSON answer


@dataclass(frozen=True, slots=True)
class Sample:
    """One request as the client saw it."""

    latency_s: float  # from its send to its answer's last byte (or its failure)
    error: str = ""  # why it failed; empty when it succeeded


def prompts(count: int, *, prompt_tokens: int, prefixes: int, seed: int) -> list[list[int]]:
    """``count`` prompts of ``prompt_tokens`` ids: the first three quarters one of
    ``prefixes`` shared heads (as system prompts are), the rest each prompt's own."""
    if count < 0 or prompt_tokens < 1 or prefixes < 1:
        raise ValueError(f"count {count}, prompt_tokens {prompt_tokens}, prefixes {prefixes}")
    rng = random.Random(f"ringfence.bench.router-latency:{seed}")
    head = prompt_tokens * 3 // 4
    heads = [[rng.randint(FIRST_ID, LAST_ID) for _ in range(head)] for _ in range(prefixes)]
    tail = prompt_tokens - head
    return [
        heads[rng.randrange(prefixes)] + [rng.randint(FIRST_ID, LAST_ID) for _ in range(tail)]
        for _ in range(count)
    ]


def body_of(ids: Sequence[int], shape: Shape, *, max_tokens: int) -> bytes:
    """The JSON body of a request for ``ids`` sent as ``shape.prompt`` says: ``ids`` as a
    list of token ids, ``text`` as the string whose bytes they are, ``chat`` as that string
    in one user message (to :data:`PATHS`' path)."""
    body: dict[str, object] = {"model": "stub", "max_tokens": max_tokens, "temperature": 0}
    text = bytes(ids).decode("ascii")
    if shape.prompt == "ids":
        body["prompt"] = list(ids)
    elif shape.prompt == "text":
        body["prompt"] = text
    elif shape.prompt == "chat":
        body["messages"] = [{"role": "user", "content": text}]
    else:
        raise ValueError(f"prompt must be one of {', '.join(PROMPTS)}: got {shape.prompt!r}")
    if shape.stream:
        body["stream"] = True
    return orjson.dumps(body)


async def send(connection: Connection, path: str, body: bytes, *, stream: bool) -> Sample:
    """One request, timed; its answer read to the end and checked (see the module
    docstring). The check runs after the clock stops."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(TIMEOUT_S):
            answer = await connection.post(path, body)
    except (OSError, BadAnswer) as e:  # ConnectionError and TimeoutError are OSErrors
        return Sample(time.perf_counter() - start, f"{type(e).__name__}: {e}")
    took = time.perf_counter() - start
    content = answer.body
    if answer.status != 200:
        return Sample(took, f"HTTP {answer.status}: {content[:200]!r}")
    if stream:
        if not content.endswith(DONE_TAIL):
            return Sample(took, f"the stream ended without [DONE]: {content[-80:]!r}")
        return Sample(took)
    try:
        ok = bool(orjson.loads(content).get("choices"))
    except (orjson.JSONDecodeError, AttributeError):
        ok = False
    return Sample(took) if ok else Sample(took, f"no choices in the answer: {content[:200]!r}")


async def closed_loop(
    workers: Sequence[dict[str, Connection]], bases: Sequence[str], path: str,
    bodies: Sequence[bytes], *, stream: bool,
) -> list[Sample]:  # fmt: skip
    """Every body sent once (closed loop) by as many workers as ``workers`` has (each its
    connections by base URL, opened as needed), body ``n`` to ``bases[n % len(bases)]``;
    the samples in the bodies' order."""
    samples: list[Sample | None] = [None] * len(bodies)
    todo = iter(range(len(bodies)))  # shared by the workers: one event loop, no lock needed

    async def worker(connections: dict[str, Connection]) -> None:
        for n in todo:
            base = bases[n % len(bases)]
            connection = connections.get(base)
            if connection is None:
                connection = connections[base] = Connection(base)
            samples[n] = await send(connection, path, bodies[n], stream=stream)

    await asyncio.gather(*(worker(w) for w in workers))
    return [s for s in samples if s is not None]


def rounds_of(count: int, rounds: int) -> list[range]:
    """``range(count)`` cut into ``rounds`` consecutive slices as equal as can be (the first
    ones a request longer); none empty unless ``count < rounds``."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    size, extra = divmod(count, rounds)
    out, start = [], 0
    for n in range(rounds):
        end = start + size + (1 if n < extra else 0)
        out.append(range(start, end))
        start = end
    return out


def side_order(round_index: int) -> tuple[str, str]:
    """Which side goes first in a round: direct in even rounds, the router in odd ones."""
    return SIDES if round_index % 2 == 0 else (SIDES[1], SIDES[0])


async def measure(
    direct: Sequence[str], router: str, path: str, bodies: Sequence[bytes], *, warmup: int,
    rounds: int, concurrency: int, stream: bool,
) -> dict[str, list[Sample]]:  # fmt: skip
    """One cell: the first ``warmup`` bodies on both sides (discarded), then the rest in
    ``rounds`` rounds of both sides (:func:`side_order`); each side's samples in order.
    ``direct`` are the instances' base URLs, ``router`` the router's. Each of the
    ``concurrency`` workers keeps its connections from the warm-up to the end."""
    bases = {"direct": list(direct), "router": [router]}
    workers: list[dict[str, Connection]] = [{} for _ in range(concurrency)]
    found: dict[str, list[Sample]] = {side: [] for side in SIDES}
    try:
        for side in SIDES:
            await closed_loop(workers, bases[side], path, bodies[:warmup], stream=stream)
        measured = bodies[warmup:]
        for index, part in enumerate(rounds_of(len(measured), rounds)):
            for side in side_order(index):
                found[side] += await closed_loop(
                    workers, bases[side], path, measured[part.start : part.stop], stream=stream
                )
    finally:
        for connections in workers:
            for connection in connections.values():
                connection.close()
    return found

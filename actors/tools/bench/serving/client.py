"""The serving benchmark's load generator: streamed ``/v1/completions`` requests sent at
their arrival times from one event loop, and what each one saw (a :class:`Timeline`).

One ``httpx.AsyncClient`` on one asyncio loop, one task per request (no thread per
request), as vLLM's ``benchmark_serving.py`` does with aiohttp. Each request sends its
prompt as token ids with ``stream``, ``stream_options.include_usage`` and
``return_token_ids``, and reads the server-sent events: ``data: {json}`` per chunk, then
``data: [DONE]``. A chunk's ``choices[0].token_ids`` are its new output tokens; the
usage chunk (``choices: []``) carries no token. A chunk is timed when its line arrives.

A request whose answer is not 200, whose stream breaks or ends without ``[DONE]``, or that
waits ``timeout`` seconds for the server (to connect, or for its next bytes) gets its
``error`` set and counts as failed; the run goes on.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from ringfence.actors.tools.bench.serving.stats import Timeline

DONE = "[DONE]"
DATA = "data:"
ERROR_BODY_CHARS = 200  # of an error answer's body, quoted in the request's error


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadRequest:
    """One request of a load run: what to send and when (seconds after the run starts)."""

    id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_s: float
    temperature: float = 0.0
    seed: int = 0
    session: str = ""  # the conversation it belongs to (for the launch's workload file)
    logprobs: int | None = None  # the top log probabilities each output token asks for

    def body(self, model: str | None) -> dict[str, Any]:
        """The JSON body of its streamed ``/v1/completions`` request."""
        body: dict[str, Any] = {
            "prompt": list(self.prompt_token_ids),
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }
        if self.logprobs is not None:
            body["logprobs"] = self.logprobs
        if model is not None:
            body["model"] = model
        return body


@dataclass(slots=True)
class _Stream:
    """What one response stream has shown so far (mutated by :func:`read_event`)."""

    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    done: bool = False


def read_event(line: str, now: float, stream: _Stream) -> None:
    """Fold one line of an SSE body into ``stream``: a ``data:`` line is a JSON chunk or
    ``[DONE]``; blank lines, comments (``:``) and other fields are skipped. ValueError
    naming what was wrong for a chunk that is not JSON or has no ``choices``, for
    ``token_ids`` that are not a list of ints, and for data after ``[DONE]``."""
    if not line.startswith(DATA):
        return
    data = line[len(DATA) :].strip()
    if stream.done:
        raise ValueError(f"data after [DONE]: {data[:ERROR_BODY_CHARS]!r}")
    if data == DONE:
        stream.done = True
        return
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError as e:
        raise ValueError(f"a chunk that is not JSON ({e}): {data[:ERROR_BODY_CHARS]!r}") from None
    if not isinstance(chunk, dict) or not isinstance(chunk.get("choices"), list):
        raise ValueError(f"a chunk without choices: {data[:ERROR_BODY_CHARS]!r}")
    if isinstance(chunk.get("usage"), dict):
        stream.usage = chunk["usage"]
    for choice in chunk["choices"]:
        ids = choice.get("token_ids") if isinstance(choice, dict) else None
        if ids is None:
            continue
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            raise ValueError(f"choices[].token_ids must be a list of ints, got {ids!r}")
        if ids:
            stream.chunk_s.append(now)
            stream.chunk_tokens.append(len(ids))
            stream.token_ids.extend(ids)


async def stream_completion(
    client: httpx.AsyncClient, url: str, request: LoadRequest, *, model: str | None
) -> Timeline:
    """Send ``request`` now and read its stream to the end: its :class:`Timeline` (with
    ``error`` set if it failed). ``client`` carries the timeout."""
    stream = _Stream()
    sent = time.perf_counter()
    error = ""
    try:
        async with client.stream("POST", url, json=request.body(model)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                error = f"HTTP {response.status_code}: {body[:ERROR_BODY_CHARS]}"
            else:
                async for line in response.aiter_lines():
                    read_event(line, time.perf_counter(), stream)
                if not stream.done:
                    error = "the stream ended without [DONE]"
    except (httpx.HTTPError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    return Timeline(
        id=request.id,
        sent_s=sent,
        chunk_s=tuple(stream.chunk_s),
        chunk_tokens=tuple(stream.chunk_tokens),
        end_s=time.perf_counter(),
        token_ids=tuple(stream.token_ids),
        error=error,
        usage=stream.usage,
    )


async def _at(start: float, request: LoadRequest) -> None:
    """Wait until ``request``'s arrival time (a timer, one per request). A loop's timer may
    fire up to its clock's resolution early (uvloop's is a millisecond, read once per
    iteration), so the wait is taken again for what is left: never early."""
    target = start + request.arrival_s
    while (delay := target - time.perf_counter()) > 0:
        await asyncio.sleep(delay)


async def run_load_async(
    base_url: str,
    requests: Sequence[LoadRequest],
    *,
    model: str | None,
    timeout: float,
    headers: Mapping[str, str] | None = None,
    verify: ssl.SSLContext | bool = True,
) -> tuple[list[Timeline], float]:
    """Send every request at its arrival time and read every stream: the timelines in the
    order given, and the perf_counter time the run started (arrival 0). ``headers`` go with
    every request (an API key); ``verify``: how an https server's certificate is checked."""
    url = f"{base_url.rstrip('/')}/v1/completions"
    limits = httpx.Limits(max_connections=max(1, len(requests)), max_keepalive_connections=None)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(timeout), limits=limits, headers=headers, verify=verify
    ) as client:

        async def one(request: LoadRequest) -> Timeline:
            await _at(start, request)
            return await stream_completion(client, url, request, model=model)

        start = time.perf_counter()
        timelines = await asyncio.gather(*(one(r) for r in requests))
    return list(timelines), start


def run_load(
    base_url: str,
    requests: Sequence[LoadRequest],
    *,
    model: str | None,
    timeout: float,
    headers: Mapping[str, str] | None = None,
    verify: ssl.SSLContext | bool = True,
) -> tuple[list[Timeline], float]:
    """:func:`run_load_async` on a fresh event loop (from synchronous code)."""
    return asyncio.run(
        run_load_async(
            base_url, requests, model=model, timeout=timeout, headers=headers, verify=verify
        )
    )


def served_model(
    base_url: str,
    *,
    timeout: float,
    headers: Mapping[str, str] | None = None,
    verify: ssl.SSLContext | bool = True,
) -> str:
    """``data[0].id`` of ``GET /v1/models``; ValueError naming what the answer lacked."""
    answer = httpx.get(
        f"{base_url.rstrip('/')}/v1/models", timeout=timeout, headers=headers, verify=verify
    )
    answer.raise_for_status()
    data = answer.json().get("data")
    if not isinstance(data, list) or not data or not isinstance(data[0].get("id"), str):
        raise ValueError(f"GET /v1/models: no data[0].id in {answer.text[:ERROR_BODY_CHARS]!r}")
    return str(data[0]["id"])

"""A stand-in for an aggregated ``ringfence serve`` instance that answers at once: what
``ringfence bench router-latency`` puts behind the router, so that the router's own work is
all that separates a routed request from a direct one.

It speaks the part of an instance's HTTP API the router uses (``actors/serve/router_api.py``
and ``actors/serve/tokens.py``), and nothing more (what it shares with the simulated
instance is in ``instance_api.py``):

- ``GET /ringfence/instance``: role ``both``, model ``stub``, one fingerprint (every stub's
  is the same, so a router pools them), the block keys' namespace and size, and where it
  publishes KV events (null with ``--no-events``);
- ``GET /ringfence/load?after=N&wait_s=S``: an idle instance's load (no request running or
  waiting, every block free), number 1: at once when ``N`` is below 1, else at ``S``
  seconds, as a long poll answers when nothing changed;
- ``POST /tokenize``: the UTF-8 bytes of the prompt (of a chat: its contents, joined) as its
  token ids, so an ASCII text and its bytes as ids are the same prompt;
- ``POST /v1/completions`` and ``/v1/chat/completions``: ``max_tokens`` (default 4) tokens
  ``tok0 tok1 ...``, as one JSON answer or, with ``stream``, one event a token then
  ``data: [DONE]``;
- ``GET /health`` and ``GET /v1/models``.

With events on, the blocks of a completion's prompt that the stub has not published yet go
out as one ``BlockStored`` batch (``actors/events/publisher.py``: vLLM's wire format over
ZMQ) before it answers, as an engine publishes blocks it computed: the router's ``cache``
policy then follows real events and looks real keys up in its index.

Run as ``python -m ringfence.actors.tools.bench.serving.stub_instance --port 0``, it prints
``ringfence stub: listening on http://HOST:PORT (pid N)``, then ``ringfence stub: ready``,
and exits 0 on SIGINT or SIGTERM. :class:`Stub` starts one so, in a session of its own.
One process, one event loop: every route runs on it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from ringfence.actors.events.publisher import EventPublisher
from ringfence.actors.events.wire import encode_batch
from ringfence.actors.http.load import Load, LoadWatch
from ringfence.actors.tools.bench.serving import instance_api
from ringfence.actors.tools.bench.serving.instance_api import (
    BLOCK_SIZE,
    NAMESPACE,
    StandIn,
    completion_kind,
    json_response,
    prompt_ids,
)
from ringfence.cache.block_hash import block_keys
from ringfence.cache.ids import BlockHash
from ringfence.cache.kv_events import BlockStored

MODULE: Final = "ringfence.actors.tools.bench.serving.stub_instance"
NAME: Final = "stub"  # in its listening and ready lines
MODEL: Final = "stub"
FINGERPRINT: Final = "stub"
MAX_TOKENS: Final = 4  # a request's tokens when it names no max_tokens
BLOCKS: Final = 1 << 20  # the device blocks it says it has, every one free
IDLE: Final = Load(free_blocks=BLOCKS, total_blocks=BLOCKS)
LISTENING: Final = instance_api.listening_line(NAME)
READY: Final = instance_api.ready_line(NAME)


def answer(kind: str, max_tokens: int) -> dict[str, Any]:
    """The JSON answer of a request for ``max_tokens`` tokens."""
    text = "".join(f"tok{i} " for i in range(max_tokens))
    if kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        obj = "chat.completion"
    else:
        choice, obj = {"index": 0, "text": text, "logprobs": None}, "text_completion"
    choice["finish_reason"] = "length"
    return {"id": f"{MODEL}-0", "object": obj, "created": 0, "model": MODEL, "choices": [choice]}


def events(kind: str, max_tokens: int) -> list[bytes]:
    """The server-sent events of a streamed answer, ``data: [DONE]`` last."""
    head = {"id": f"{MODEL}-0", "created": 0, "model": MODEL}
    out = []
    for i in range(max_tokens):
        finish = "length" if i == max_tokens - 1 else None
        choice: dict[str, Any]
        if kind == "chat":
            choice = {"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": finish}
            chunk = {**head, "object": "chat.completion.chunk", "choices": [choice]}
        else:
            choice = {"index": 0, "text": f"tok{i} ", "logprobs": None, "finish_reason": finish}
            chunk = {**head, "object": "text_completion", "choices": [choice]}
        out.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    return [*out, b"data: [DONE]\n\n"]


class Blocks:
    """The prompt blocks a stub has published, and the batch that publishes new ones.
    Owned by the stub's event loop."""

    def __init__(self) -> None:
        self.published: set[BlockHash] = set()

    def batch_of(self, token_ids: list[int]) -> bytes | None:
        """The encoded batch of the prompt's full blocks not published yet (None: none);
        they count as published from now on."""
        keys = block_keys(token_ids, BLOCK_SIZE, namespace=NAMESPACE)
        # The keys chain: once one is new, every later one is too.
        first = next((n for n, key in enumerate(keys) if key not in self.published), len(keys))
        if first == len(keys):
            return None
        new = keys[first:]
        self.published.update(new)
        stored = BlockStored(
            keys=tuple(new), parent=keys[first - 1] if first else None,
            token_ids=tuple(token_ids[first * BLOCK_SIZE : len(keys) * BLOCK_SIZE]),
            block_size=BLOCK_SIZE, medium="GPU",
        )  # fmt: skip
        return encode_batch(time.time(), [stored], layout="map")


def build_app(
    publisher: EventPublisher | None = None, stopping: asyncio.Event | None = None
) -> Starlette:
    """The stub's app; ``publisher`` the one its events go out on (None: no events);
    ``stopping``, once set, answers every held load poll at once."""
    stopping = stopping or asyncio.Event()
    blocks = Blocks()
    watch = LoadWatch()
    watch.note(IDLE)  # number 1, for good: its load never changes
    identity = instance_api.identity_card(
        model=MODEL, fingerprint=FINGERPRINT, publisher=publisher, load=IDLE
    )

    async def complete(request: Request) -> Response:
        kind = completion_kind(request)
        body = orjson.loads(await request.body())
        if publisher is not None:
            batch = blocks.batch_of(prompt_ids(kind, body))
            if batch is not None:
                publisher.publish(batch)
        n = int(body.get("max_tokens") or MAX_TOKENS)
        if not body.get("stream"):
            return json_response(orjson.dumps(answer(kind, n)))

        async def stream() -> AsyncIterator[bytes]:
            for event in events(kind, n):
                yield event

        return StreamingResponse(stream(), media_type="text/event-stream")

    routes = instance_api.common_routes(
        model=MODEL, identity=identity, watch=watch, stopping=stopping
    )
    return Starlette(routes=[
        *routes,
        Route("/v1/completions", complete, methods=["POST"]),
        Route("/v1/chat/completions", complete, methods=["POST"]),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Serve one stub until SIGINT or SIGTERM (see the module docstring)."""
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__)
    instance_api.add_server_arguments(parser)
    return instance_api.serve(NAME, parser.parse_args(argv), build_app)


class Stub(StandIn):
    """One stub instance in a process (and session) of its own, on a free port of 127.0.0.1
    (see :class:`~.server.Started`); its output goes to ``out_path``."""

    __slots__ = ()

    def __init__(self, out_path: Path, *, events: bool, start_timeout: float) -> None:
        super().__init__(MODULE, NAME, out_path, events=events, start_timeout=start_timeout)


if __name__ == "__main__":
    sys.exit(main())

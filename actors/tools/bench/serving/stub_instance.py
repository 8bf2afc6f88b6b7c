"""A stand-in for an aggregated ``ringfence serve`` instance that answers at once: what
``ringfence bench router-latency`` puts behind the router, so that the router's own work is
all that separates a routed request from a direct one.

It speaks the part of an instance's HTTP API the router uses (``actors/serve/router_api.py``
and ``actors/serve/tokens.py``), and nothing more:

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
import contextlib
import hashlib
import os
import re
import signal
import socket
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
from ringfence.actors.tools.bench.serving.server import Started
from ringfence.cache.block_hash import block_keys
from ringfence.cache.ids import BlockHash
from ringfence.cache.kv_events import BlockStored

MODULE: Final = "ringfence.actors.tools.bench.serving.stub_instance"
MODEL: Final = "stub"
FINGERPRINT: Final = "stub"
NAMESPACE: Final = hashlib.blake2b(b"ringfence.bench.stub", digest_size=16).digest()
BLOCK_SIZE: Final = 16
MAX_TOKENS: Final = 4  # a request's tokens when it names no max_tokens
BLOCKS: Final = 1 << 20  # the device blocks it says it has, every one free
MAX_WAIT_S: Final = 30.0  # the longest it holds a GET /ringfence/load (as an instance does)
GRACE_S: Final = 1  # open connections (a held load poll) get this long when it stops
EVENTS_BUFFER: Final = 100_000  # batches the publisher keeps for a router that starts later
KEEP_ALIVE_S: Final = 300  # an idle connection kept: a client waits while its other side runs
LISTENING: Final = re.compile(
    r"^ringfence stub: listening on (?P<url>https?://\S+?) \(pid (?P<pid>\d+)\)"
)
READY: Final = re.compile(r"^ringfence stub: ready$")


def prompt_ids(kind: str, body: Any) -> list[int]:
    """The token ids the stub gives a request's prompt: ids as given, a text's UTF-8 bytes,
    a chat's contents' bytes (joined); none for a body it cannot read."""
    if not isinstance(body, dict):
        return []
    if kind == "chat" or "messages" in body:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return []
        return list("".join(str(m.get("content", "")) for m in messages).encode())
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return list(str(prompt).encode()) if isinstance(prompt, str) else []


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
    card = None
    if publisher is not None:
        ends = publisher.endpoints
        card = {"endpoint": ends.publish, "replay_endpoint": ends.replay}
    idle = {"pending": 0, "running": 0, "waiting": 0, "reservations": 0,
            "free_blocks": BLOCKS, "total_blocks": BLOCKS}  # fmt: skip
    identity = orjson.dumps({
        "role": "both", "model": MODEL, "model_id": MODEL, "fingerprints": [FINGERPRINT],
        "namespace": NAMESPACE.hex(), "events": card, "block_size": BLOCK_SIZE, "tp_size": 1,
        "max_model_len": 1 << 20, "serving": True, "load": idle,
    })  # fmt: skip
    load_answer = orjson.dumps({"seq": 1, **idle})

    def json(content: bytes) -> Response:
        return Response(content, media_type="application/json")

    async def instance(request: Request) -> Response:
        return json(identity)

    async def load(request: Request) -> Response:
        """Its load never changes: number 1, at once to a caller that has not seen it."""
        try:
            after = int(request.query_params.get("after", "0"))
            wait_s = min(max(float(request.query_params.get("wait_s", "0")), 0.0), MAX_WAIT_S)
        except ValueError:
            return Response(b'{"error":"after and wait_s are numbers"}', status_code=400)
        if after >= 1:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), wait_s)
        return json(load_answer)

    async def health(request: Request) -> Response:
        return json(b'{"status":"ok"}')

    async def models(request: Request) -> Response:
        return json(orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))

    async def tokenize(request: Request) -> Response:
        ids = prompt_ids("completions", orjson.loads(await request.body()))
        return json(orjson.dumps({"count": len(ids), "max_model_len": 1 << 20, "tokens": ids}))

    async def complete(request: Request) -> Response:
        kind = "chat" if request.url.path.endswith("/chat/completions") else "completions"
        body = orjson.loads(await request.body())
        if publisher is not None:
            batch = blocks.batch_of(prompt_ids(kind, body))
            if batch is not None:
                publisher.publish(batch)
        n = int(body.get("max_tokens") or MAX_TOKENS)
        if not body.get("stream"):
            return json(orjson.dumps(answer(kind, n)))

        async def stream() -> AsyncIterator[bytes]:
            for event in events(kind, n):
                yield event

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[
        Route("/ringfence/instance", instance, methods=["GET"]),
        Route("/ringfence/load", load, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/v1/completions", complete, methods=["POST"]),
        Route("/v1/chat/completions", complete, methods=["POST"]),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Serve one stub until SIGINT or SIGTERM (see the module docstring)."""
    import uvicorn

    from ringfence.actors.router.server import listen

    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--no-events", action="store_true", help="publish no KV events")
    args = parser.parse_args(argv)
    sock: socket.socket = listen(args.host, args.port)
    publisher = None
    if not args.no_events:
        publisher = EventPublisher(
            f"tcp://{args.host}:0", f"tcp://{args.host}:0", buffer_steps=EVENTS_BUFFER
        )
    # SIGTERM stops it as SIGINT does: uvicorn raises the signal again once it stopped,
    # and this handler makes that a KeyboardInterrupt, caught below, for either signal.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    stopping = asyncio.Event()

    class Server(uvicorn.Server):
        """uvicorn, answering the held load polls first when it stops (they would hold the
        stop up to their ``wait_s``)."""

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            stopping.set()
            await super().shutdown(sockets)

    config = uvicorn.Config(
        build_app(publisher, stopping),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=GRACE_S,
    )
    host, port = sock.getsockname()[:2]
    print(f"ringfence stub: listening on http://{host}:{port} (pid {os.getpid()})")
    print("ringfence stub: ready", flush=True)
    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        if publisher is not None:
            publisher.close()
    return 0


class Stub(Started):
    """One stub instance in a process (and session) of its own, on a free port of 127.0.0.1
    (see :class:`~.server.Started`); its output goes to ``out_path``."""

    __slots__ = ()

    def __init__(self, out_path: Path, *, events: bool, start_timeout: float) -> None:
        args = [sys.executable, "-m", MODULE, "--host", "127.0.0.1", "--port", "0"]
        if not events:
            args.append("--no-events")
        out_path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(
            args, what="stub instance", out_path=out_path, cwd=out_path.parent,
            listening=LISTENING, ready=READY, start_timeout=start_timeout,
        )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

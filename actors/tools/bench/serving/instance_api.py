"""The part of an aggregated instance's HTTP API that the router uses, shared by the
benchmarks' stand-ins for ``ringfence serve``: the stub (``stub_instance.py``, answers at
once) and the simulated instance (``sim_instance.py``, a modelled engine).

What is the same for both lives here: the prompt's token ids, the identity card, the
routes that do not run a request (``/ringfence/instance``, ``/ringfence/load`` as a long
poll on a :class:`~ringfence.actors.http.load.LoadWatch`, ``/tokenize``, ``/health``,
``/v1/models``), the process around an app (its command-line, its listening and ready
lines, its KV event publisher, its stop on SIGINT or SIGTERM), and :class:`StandIn`, which
starts one in a session of its own. Each stand-in adds its completion routes.

A stand-in prints ``ringfence NAME: listening on http://HOST:PORT (pid N)``, then
``ringfence NAME: ready``, and exits 0 on SIGINT or SIGTERM. One process, one event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import re
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ringfence.actors.events.publisher import EventPublisher
from ringfence.actors.http.load import Load, LoadWatch
from ringfence.actors.tools.bench.serving.server import Started

# Every stand-in hashes blocks as the stub always did: a router pools them by this.
NAMESPACE: Final = hashlib.blake2b(b"ringfence.bench.stub", digest_size=16).digest()
BLOCK_SIZE: Final = 16
MAX_MODEL_LEN: Final = 1 << 20
MAX_WAIT_S: Final = 30.0  # the longest it holds a GET /ringfence/load (as an instance does)
GRACE_S: Final = 1  # open connections (a held load poll) get this long when it stops
EVENTS_BUFFER: Final = 100_000  # batches the publisher keeps for a router that starts later
KEEP_ALIVE_S: Final = 300  # an idle connection kept: a client waits while its other side runs

# Builds a stand-in's app from its publisher (None: no events) and the event set when the
# server stops (held load polls answer then).
AppFactory = Callable[[EventPublisher | None, asyncio.Event], Starlette]


def listening_line(name: str) -> re.Pattern[str]:
    """The pattern of stand-in ``name``'s listening line (groups ``url`` and ``pid``)."""
    return re.compile(
        rf"^ringfence {re.escape(name)}: listening on (?P<url>https?://\S+?) \(pid (?P<pid>\d+)\)"
    )


def ready_line(name: str) -> re.Pattern[str]:
    return re.compile(rf"^ringfence {re.escape(name)}: ready$")


def prompt_ids(kind: str, body: Any) -> list[int]:
    """The token ids a stand-in gives a request's prompt: ids as given, a text's UTF-8
    bytes, a chat's contents' bytes (joined); none for a body it cannot read."""
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


def completion_kind(request: Request) -> str:
    """``chat`` for ``/v1/chat/completions``, else ``completions``."""
    return "chat" if request.url.path.endswith("/chat/completions") else "completions"


def json_response(content: bytes) -> Response:
    return Response(content, media_type="application/json")


def identity_card(
    *, model: str, fingerprint: str, publisher: EventPublisher | None, load: Load
) -> bytes:
    """The body of ``GET /ringfence/instance``: an aggregated instance of ``model`` that
    hashes blocks under :data:`NAMESPACE` and publishes its KV events on ``publisher``."""
    card = None
    if publisher is not None:
        ends = publisher.endpoints
        card = {"endpoint": ends.publish, "replay_endpoint": ends.replay}
    return orjson.dumps({
        "role": "both", "model": model, "model_id": model, "fingerprints": [fingerprint],
        "namespace": NAMESPACE.hex(), "events": card, "block_size": BLOCK_SIZE, "tp_size": 1,
        "max_model_len": MAX_MODEL_LEN, "serving": True, "load": load.as_dict(),
    })  # fmt: skip


def common_routes(
    *, model: str, identity: bytes, watch: LoadWatch, stopping: asyncio.Event
) -> list[Route]:
    """The routes that run no request. ``GET /ringfence/load?after=N&wait_s=S`` answers
    ``watch``'s newest load at once when its number is past ``N``, else at its next change,
    at ``S`` seconds (at most :data:`MAX_WAIT_S`) or once ``stopping`` is set."""

    async def instance(request: Request) -> Response:
        return json_response(identity)

    async def load(request: Request) -> Response:
        try:
            after = int(request.query_params.get("after", "0"))
            wait_s = min(max(float(request.query_params.get("wait_s", "0")), 0.0), MAX_WAIT_S)
        except ValueError:
            return Response(b'{"error":"after and wait_s are numbers"}', status_code=400)
        changed = asyncio.ensure_future(watch.after(after, wait_s))
        stopped = asyncio.ensure_future(stopping.wait())
        try:
            # watch.after returns by wait_s at the latest: its deadline is this wait's.
            await asyncio.wait((changed, stopped), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            changed.cancel()
        return json_response(orjson.dumps(watch.answer(watch.seq, watch.load)))

    async def health(request: Request) -> Response:
        return json_response(b'{"status":"ok"}')

    async def models(request: Request) -> Response:
        data = {"object": "list", "data": [{"id": model, "object": "model"}]}
        return json_response(orjson.dumps(data))

    async def tokenize(request: Request) -> Response:
        ids = prompt_ids("completions", orjson.loads(await request.body()))
        return json_response(
            orjson.dumps({"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids})
        )

    return [
        Route("/ringfence/instance", instance, methods=["GET"]),
        Route("/ringfence/load", load, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
    ]


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every stand-in takes: where it listens, and whether it publishes."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--no-events", action="store_true", help="publish no KV events")


def serve(name: str, args: argparse.Namespace, build: AppFactory) -> int:
    """Serve the app ``build`` makes until SIGINT or SIGTERM (see the module docstring);
    ``args`` as :func:`add_server_arguments` parsed them. Returns 0."""
    import uvicorn

    from ringfence.actors.router.server import listen

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
        build(publisher, stopping),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_keep_alive=KEEP_ALIVE_S,
        timeout_graceful_shutdown=GRACE_S,
    )
    host, port = sock.getsockname()[:2]
    print(f"ringfence {name}: listening on http://{host}:{port} (pid {os.getpid()})")
    print(f"ringfence {name}: ready", flush=True)
    try:
        Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        if publisher is not None:
            publisher.close()
    return 0


class StandIn(Started):
    """Stand-in ``name`` (the module ``module``, run with ``options``) in a process and
    session of its own on a free port of 127.0.0.1 (see :class:`~.server.Started`); its
    output goes to ``out_path``."""

    __slots__ = ()

    def __init__(
        self,
        module: str,
        name: str,
        out_path: Path,
        *,
        events: bool,
        start_timeout: float,
        options: tuple[str, ...] = (),
    ) -> None:
        args = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", "0", *options]
        if not events:
            args.append("--no-events")
        out_path.parent.mkdir(parents=True, exist_ok=True)
        super().__init__(
            args, what=f"{name} instance", out_path=out_path, cwd=out_path.parent,
            listening=listening_line(name), ready=ready_line(name),
            start_timeout=start_timeout,
        )  # fmt: skip

"""A stand-in for ``ringfence serve`` that speaks its HTTP framing and nothing more.

:func:`app` is a Starlette app: ``GET /v1/models`` names one model (``fake``); ``POST
/v1/completions`` with ``stream`` answers server-sent events, ``data: {json}`` per chunk,
one output token a chunk (``choices[0].token_ids``), the usage chunk (``choices: []``)
when ``stream_options.include_usage``, then ``data: [DONE]``. The output is a pure
function of the request: token ``i`` is ``(last prompt token + 1 + i) % 256``, so a test
knows every token before it asks. Some seeds misbehave on purpose (see ``SEED_*``).

Run as a script (``python fake_serve.py serve --run-dir D --host H --port P [--set
K=V ...]``) it listens on H:P, prints ``ringfence serve``'s listening line with its own
pid as the front end's and its ready line, and exits 0 on SIGINT, as the real command does.
Like it, it asks for the keys of ``RINGFENCE_API_KEY`` and serves HTTPS with
``server.ssl_certfile`` and ``server.ssl_keyfile``; it reads no other setting.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import sys
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "fake"
SEED_BAD_REQUEST = 1000  # answered 400 with an OpenAI-style error
SEED_NO_DONE = 1001  # the stream ends after its tokens, without [DONE]
SEED_TWO_A_CHUNK = 1002  # two tokens a chunk


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """The output the fake streams for ``prompt``."""
    return [(prompt[-1] + 1 + i) % 256 for i in range(max_tokens)]


def _event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


async def _models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})


async def _completions(request: Request) -> Response:
    body = await request.json()
    prompt, max_tokens, seed = body["prompt"], body["max_tokens"], body.get("seed", 0)
    if seed == SEED_BAD_REQUEST:
        error = {"message": "bad seed", "type": "invalid_request_error", "param": "seed"}
        return JSONResponse({"error": {**error, "code": None}}, status_code=400)
    tokens = expected_tokens(prompt, max_tokens)
    per_chunk = 2 if seed == SEED_TWO_A_CHUNK else 1

    async def events() -> AsyncIterator[bytes]:
        yield b": a comment line, skipped\n\n"
        for start in range(0, len(tokens), per_chunk):
            ids = tokens[start : start + per_chunk]
            last = start + per_chunk >= len(tokens)
            choice = {
                "index": 0,
                "text": "x" * len(ids),
                "token_ids": ids,
                "finish_reason": "length" if last else None,
            }
            yield _event({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})
        if seed == SEED_NO_DONE:
            return
        if body.get("stream_options", {}).get("include_usage"):
            usage = {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(tokens),
                "total_tokens": len(prompt) + len(tokens),
            }
            yield _event({"id": "cmpl-1", "choices": [], "usage": usage})
        yield _event("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream")


def app(*ready_lines: str) -> Starlette:
    """The fake's routes; ``ready_lines`` are printed once the server has started (its
    signal handlers installed, its loop running), so a SIGINT after them is a clean stop."""

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        for line in ready_lines:
            print(line, flush=True)
        yield

    return Starlette(
        routes=[
            Route("/v1/models", _models, methods=["GET"]),
            Route("/v1/completions", _completions, methods=["POST"]),
        ],
        lifespan=lifespan,
    )


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound and listening on ``host:port`` (0: any free port): connections wait
    in its backlog until the server accepts them, so nobody has to wait for start-up."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def main(argv: list[str]) -> int:
    import os
    import signal

    # SIGINT is the stop, as for the real command; a shell's background job (a CI script
    # run with &) would otherwise start with it ignored, and a SIGINT before uvicorn's own
    # handlers would be lost.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--set", action="append", default=[])
    args = parser.parse_args(argv)
    from ringfence.actors.http.auth import RequireKey, load_keys
    from ringfence.actors.http.tls import SERVE_NAMES, ListenerTls, scheme

    sets = dict(setting.partition("=")[::2] for setting in args.set)
    tls = ListenerTls.of(
        sets.get("server.ssl_keyfile", ""), sets.get("server.ssl_certfile", ""), "", SERVE_NAMES
    )
    sock = listening_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"{scheme(tls)}://{host}:{port}"
    lines = (
        f"ringfence serve: listening on {url} (front end pid {os.getpid()})",
        "ringfence serve: ready",
    )
    application: Any = RequireKey(app(*lines), load_keys())
    options = tls.uvicorn_options() if tls is not None else {}
    server = uvicorn.Server(uvicorn.Config(application, log_level="warning", **options))
    # A SIGINT from here on stops it cleanly, exit 0 (uvicorn returns on SIGINT after the
    # requests in flight, then re-raises the signal; one before it started is a stop too).
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The body limit (actors/http/limits.py): 413 in OpenAI's error body for a body over the
limit, whether its Content-Length says so or it comes in chunks; the app reads no further."""

from __future__ import annotations

from collections.abc import Iterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from ringfence.actors.http.limits import LimitBody

LIMIT = 2048


def echo_app(read: list[int]) -> Starlette:
    async def echo(request: Request) -> PlainTextResponse:
        body = await request.body()
        read.append(len(body))
        return PlainTextResponse(f"{len(body)} bytes")

    routes = [Route("/echo", echo, methods=["POST"])]
    return Starlette(routes=routes, middleware=[Middleware(LimitBody, max_bytes=LIMIT)])


def chunks(total: int, size: int = 512) -> Iterator[bytes]:
    for start in range(0, total, size):
        yield b"x" * min(size, total - start)


def test_a_body_over_the_limit_is_413_and_one_at_it_is_read():
    read: list[int] = []
    with TestClient(echo_app(read)) as client:
        refused = client.post("/echo", content=b"x" * (LIMIT + 1))
        assert refused.status_code == 413
        assert refused.json()["error"]["code"] == "request_too_large"
        assert f"larger than {LIMIT} bytes" in refused.json()["error"]["message"]
        assert read == []  # refused on its Content-Length: not a byte read
        ok = client.post("/echo", content=b"x" * LIMIT)
        assert (ok.status_code, ok.text) == (200, f"{LIMIT} bytes")


def test_a_chunked_body_is_refused_once_it_passes_the_limit():
    read: list[int] = []
    with TestClient(echo_app(read)) as client:
        refused = client.post("/echo", content=chunks(LIMIT * 4))
        assert refused.status_code == 413
        assert read == []  # the route never got the body
        ok = client.post("/echo", content=chunks(LIMIT - 100))
        assert (ok.status_code, ok.text) == (200, f"{LIMIT - 100} bytes")

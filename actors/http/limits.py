"""What a request's body may cost: its size (``server.max_body_bytes``, 413 past it) and the
time it takes to arrive (``server.body_timeout_s``, 408 past it); read no further either way.

A body whose ``Content-Length`` says it is too large is refused before a byte of it is read;
one sent in chunks (or longer than it said) is counted as it arrives, and refused the moment
it passes the limit, so a client cannot make the server hold more than the limit in memory.
A body still arriving ``timeout_s`` after its request's head ended (a client sending a byte
a second) is refused then, so a slow client holds its connection no longer than that. Both
answers are OpenAI's error body (``code: request_too_large`` / ``request_timeout``) with
``Connection: close``.

How the refusal reaches the client whatever the app makes of it: the wrapped ``receive``
answers the app ``http.disconnect`` (a client gone: the app stops reading, whatever it then
raises or answers), and the app's own answer is dropped, replaced by the refusal. Raising
into the app instead would not do: FastAPI turns any exception met while reading a body into
its own 400.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ringfence.actors.http.errors import error_body, send_error

CLOSE = [(b"connection", b"close")]
MAX_N = 128  # choices per request at most (its ``n``): OpenAI's bound (each one engine request)


def too_large(limit: int) -> bytes:
    return orjson.dumps(
        error_body(
            f"the request body is larger than {limit} bytes (server.max_body_bytes)",
            code="request_too_large",
        )
    )


def too_slow(timeout_s: float) -> bytes:
    return orjson.dumps(
        error_body(
            f"the request body did not arrive within {timeout_s:g} s (server.body_timeout_s)",
            code="request_timeout",
        )
    )


@dataclass(frozen=True, slots=True)
class LimitBody:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413, one not arrived
    ``timeout_s`` after the request's head 408 (None: no time limit)."""

    app: ASGIApp
    max_bytes: int
    timeout_s: float | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit() or int(value) > self.max_bytes:
                    await send_error(send, 413, too_large(self.max_bytes), CLOSE)
                    return
                break
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        seen = 0
        ended = False  # the whole body arrived: receive is the app's again
        refusal: tuple[int, bytes] | None = None  # what the client gets instead of the app's
        started = False  # the app's answer began going out (before the body ended)

        async def guarded() -> Message:
            nonlocal seen, ended, refusal
            if ended or refusal is not None:
                return await receive() if refusal is None else {"type": "http.disconnect"}
            try:
                if deadline is None:
                    message = await receive()
                else:
                    message = await asyncio.wait_for(receive(), deadline - time.monotonic())
            except TimeoutError:
                refusal = (408, too_slow(self.timeout_s or 0.0))
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    refusal = (413, too_large(self.max_bytes))
                    return {"type": "http.disconnect"}
                ended = not message.get("more_body", False)
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            if refusal is not None and not started:
                return  # the app's answer to a body it did not get: the refusal goes instead
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, guarded, watched)
        except Exception:
            if refusal is None or started:
                raise
        if refusal is not None and not started:
            await send_error(send, *refusal, CLOSE)

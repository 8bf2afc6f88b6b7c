"""The limit on a request's body (``server.max_body_bytes``): 413 past it, read no further.

A body whose ``Content-Length`` says it is too large is refused before a byte of it is read;
one sent in chunks (or longer than it said) is counted as it arrives, and refused the moment
it passes the limit, so a client cannot make the server hold more than the limit in memory.
The answer is OpenAI's error body, ``code: request_too_large``.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ringfence.actors.serve.api import error_body, send_error


class BodyTooLarge(Exception):
    """Raised into the app by the wrapped ``receive`` once the body passed the limit."""


def too_large(limit: int) -> bytes:
    return orjson.dumps(
        error_body(
            f"the request body is larger than {limit} bytes (server.max_body_bytes)",
            code="request_too_large",
        )
    )


@dataclass(frozen=True, slots=True)
class LimitBody:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413."""

    app: ASGIApp
    max_bytes: int

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit() or int(value) > self.max_bytes:
                    await self._refuse(send)
                    return
                break
        seen = 0
        started = False

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge
            return message

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, watched)
        except BodyTooLarge:
            if started:  # an answer that began before the body ended: it ends here
                raise
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        await send_error(send, 413, too_large(self.max_bytes), [(b"connection", b"close")])

"""OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, and the error
that carries it: every 4xx and 5xx answer of ``ringfence serve`` and ``ringfence router``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel
from starlette.types import Send

from ringfence.shm.errors import RingfenceError


class ApiError(RingfenceError, ValueError):
    """A request the server answers with an error status and OpenAI's error body."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param  # the request field at fault, dotted ("messages.0.content")
        self.status = status
        self.kind = kind
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, param=self.param, kind=self.kind, code=self.code)


def error_body(
    message: str, *, param: str | None = None, kind: str = "invalid_request_error",
    code: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


async def send_error(
    send: Send, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """Answer an ASGI call with ``body`` (an :func:`error_body`, as JSON bytes) from a
    middleware, before any route ran."""
    head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": [*head, *headers]})
    await send({"type": "http.response.body", "body": body})


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx and 5xx answer of the API."""

    error: ErrorDetail

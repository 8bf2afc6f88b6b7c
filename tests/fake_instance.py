"""A stand-in for a ``ringfence serve`` instance of role prefill or decode: the hand-over's
HTTP contract and nothing more, with knobs that make it misbehave on purpose.

:class:`FakeInstance` serves a Starlette app on 127.0.0.1 (a free port) in a thread, and
records every call it got (:class:`Call`) in its own list and, in order, in a journal
that several fakes may share, so a test reads the order of calls across instances.

A decode fake grants ``rsv-1``, ``rsv-2``... whose ``prompt_token_ids`` are the prompt's
bytes (a string prompt or the messages' contents) or the prompt's ids, and answers a claim
with ``max_tokens`` (default 4) tokens ``tok0 tok1 ...``, as OpenAI's JSON or as events
(:func:`event_bytes` says exactly which bytes).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from fake_serve import listening_socket
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ringfence.actors.http.auth import Keys, RequireKey
from ringfence.actors.http.tls import ListenerTls
from ringfence.actors.router.server import nodelay
from ringfence.actors.serve.server import HttpThread

HEADER = "x-ringfence-reservation"
MODEL = "fake"


@dataclass
class Knobs:
    """How the fake behaves; a test may change a field while the fake runs."""

    role: str = "decode"
    fingerprints: tuple[str, ...] = ("f0",)
    storage_secret_id: str | None = None  # the identifier of its storage secret (None: none)
    no_room: int = 0  # reserve answers 503 no_room this many times first
    retry_after: str = "0"  # the Retry-After of a no_room
    bad_field: str | None = None  # reserve answers 400 naming this field
    expire_once: bool = False  # the first claim answers 409 reservation_expired
    ttl_s: float = 10.0  # the reservations' ttl_s
    prefill: str = "ok"  # "ok", "slow" (prefill_delay_s first), "503", "garbage"
    prefill_delay_s: float = 1.0
    die_after: int | None = None  # a claim's answer breaks after this many events (plain: bytes)
    gate: threading.Event | None = None  # a claim's stream waits here after its first event
    api_key: str = ""  # every route but /health asks for this key (as ringfence serve's)
    salt_by_key: bool = False  # what its identity says of server.salt_by_key


@dataclass(frozen=True)
class Call:
    """One request the fake got."""

    path: str
    body: Any  # the JSON body (None for a GET)
    raw: bytes
    reservation: str | None  # the X-Ringfence-Reservation header


def prompt_ids(kind: str, body: dict[str, Any]) -> list[int]:
    """The token ids the fake says a request's prompt has."""
    if kind == "chat":
        return list("".join(str(m.get("content")) for m in body["messages"]).encode())
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else list(str(prompt).encode())


def chunks(kind: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The events' payloads of a streamed answer (before ``[DONE]``)."""
    n = int(body.get("max_tokens") or 4)
    head = {"id": f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-fake", "created": 0, "model": MODEL}
    out: list[dict[str, Any]] = []
    for i in range(n):
        finish = "length" if i == n - 1 else None
        if kind == "chat":
            delta = (
                {"role": "assistant", "content": f"tok{i} "} if i == 0 else {"content": f"tok{i} "}
            )
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            out.append({**head, "object": "chat.completion.chunk", "choices": [choice]})
        else:
            choice = {"index": 0, "text": f"tok{i} ", "logprobs": None, "finish_reason": finish}
            out.append({**head, "object": "text_completion", "choices": [choice]})
    return out


def event_bytes(kind: str, body: dict[str, Any]) -> bytes:
    """Exactly what the fake streams for a claim of ``body``."""
    events = [b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks(kind, body)]
    return b"".join(events) + b"data: [DONE]\n\n"


def whole(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """The fake's JSON answer to a claim of ``body``."""
    n = int(body.get("max_tokens") or 4)
    text = "".join(f"tok{i} " for i in range(n))
    usage = {"prompt_tokens": len(prompt_ids(kind, body)), "completion_tokens": n}
    usage["total_tokens"] = usage["prompt_tokens"] + n
    if kind == "chat":
        message = {"role": "assistant", "content": text}
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": "length"}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        obj = "text_completion"
    return {"id": "fake", "object": obj, "created": 0, "model": MODEL, "choices": [choice],
            "usage": usage}  # fmt: skip


def error(status: int, message: str, code: str | None = None, param: str | None = None,
          headers: dict[str, str] | None = None) -> JSONResponse:  # fmt: skip
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


@dataclass
class FakeInstance:
    """One fake instance (start() it; stop() it once)."""

    name: str
    knobs: Knobs
    journal: list[tuple[str, str]] = field(default_factory=list)  # (name, path), shared
    calls: list[Call] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)  # reservations whose stream the client left
    url: str = ""
    tls: ListenerTls | None = None  # HTTPS with these files (the URL is https://)
    _granted: int = 0
    _live: set[str] = field(default_factory=set)
    _http: HttpThread | None = None

    def start(self) -> FakeInstance:
        sock = listening_socket("127.0.0.1", 0)
        nodelay(sock)
        host, port = sock.getsockname()[:2]
        self.url = f"{'https' if self.tls else 'http'}://{host}:{port}"
        self._http = HttpThread(self.app(), sock, asyncio.new_event_loop(), self.tls)
        self._http.start()
        return self

    def stop(self) -> None:
        """Stop serving (connections to the port are refused from then on)."""
        if self._http is not None:
            http, self._http = self._http, None
            assert http.stop(5.0), f"fake {self.name} did not stop"

    def paths(self) -> list[str]:
        return [c.path for c in self.calls]

    def app(self) -> Starlette:
        routes = [
            Route("/ringfence/instance", self._identity, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/ringfence/reserve", self._reserve, methods=["POST"]),
            Route("/ringfence/prefill", self._prefill, methods=["POST"]),
            Route("/v1/completions", self._claim, methods=["POST"]),
            Route("/v1/chat/completions", self._claim, methods=["POST"]),
        ]
        if not self.knobs.api_key:
            return Starlette(routes=routes)
        keys = Keys([self.knobs.api_key])
        return Starlette(routes=routes, middleware=[Middleware(RequireKey, keys=keys)])

    async def _record(self, request: Request) -> Call:
        raw = await request.body()
        body = orjson.loads(raw) if raw else None
        call = Call(request.url.path, body, raw, request.headers.get(HEADER))
        self.calls.append(call)
        self.journal.append((self.name, call.path))
        return call

    async def _identity(self, request: Request) -> Response:
        await self._record(request)
        return JSONResponse({
            "role": self.knobs.role, "model": MODEL, "model_id": "m0",
            "fingerprints": list(self.knobs.fingerprints), "block_size": 16, "tp_size": 1,
            "storage_secret_id": self.knobs.storage_secret_id,
            "max_model_len": 2048, "salt_by_key": self.knobs.salt_by_key,
            "load": {"pending": 0, "running": 0, "waiting": 0,
            "reservations": len(self._live), "free_blocks": 100, "total_blocks": 100},
        })  # fmt: skip

    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _reserve(self, request: Request) -> Response:
        call, knobs = await self._record(request), self.knobs
        if knobs.role != "decode":
            return error(409, "not a decode instance", "wrong_role")
        if knobs.bad_field is not None:
            return error(400, f"{knobs.bad_field}: bad value", param=knobs.bad_field)
        if knobs.no_room > 0:
            knobs.no_room -= 1
            headers = {"Retry-After": knobs.retry_after}
            return error(503, "no room for the request now", "no_room", headers=headers)
        self._granted += 1
        rid = f"rsv-{self._granted}"
        self._live.add(rid)
        ids = prompt_ids(call.body["kind"], call.body["body"])
        return JSONResponse({"reservation_id": rid, "ttl_s": knobs.ttl_s, "blocks": 1,
                             "prompt_tokens": len(ids), "prompt_token_ids": ids})  # fmt: skip

    async def _prefill(self, request: Request) -> Response:
        call, knobs = await self._record(request), self.knobs
        if knobs.prefill == "slow":
            await asyncio.sleep(knobs.prefill_delay_s)
        elif knobs.prefill == "503":
            return error(503, "too many pending", "overloaded", headers={"Retry-After": "1"})
        elif knobs.prefill == "garbage":
            return Response(b"not json", media_type="text/plain")
        n = len(call.body["prompt_token_ids"])
        return JSONResponse(
            {"prompt_tokens": n, "stored_blocks": n // 16, "first_token_id": 1, "ttft_s": 0.001}
        )

    async def _claim(self, request: Request) -> Response:
        call, knobs = await self._record(request), self.knobs
        kind = "chat" if call.path.endswith("chat/completions") else "completions"
        if call.reservation is None:
            return error(409, "a decode instance answers only claims", "reservation_required")
        if knobs.expire_once or call.reservation not in self._live:
            knobs.expire_once = False
            self._live.discard(call.reservation)
            return error(409, "the reservation expired", "reservation_expired")
        self._live.discard(call.reservation)
        if not call.body.get("stream"):
            content = orjson.dumps(whole(kind, call.body))
            if knobs.die_after is None:
                return Response(content, media_type="application/json")
            return StreamingResponse(self._broken(content[: knobs.die_after]))
        return StreamingResponse(
            self._events(kind, call.body, call.reservation), media_type="text/event-stream"
        )

    async def _broken(self, head: bytes) -> AsyncIterator[bytes]:
        yield head
        raise RuntimeError("the fake decode instance dies mid-answer")

    async def _events(self, kind: str, body: dict[str, Any], rid: str) -> AsyncIterator[bytes]:
        knobs, ended = self.knobs, False
        try:
            for i, chunk in enumerate(chunks(kind, body)):
                if i == knobs.die_after:
                    raise RuntimeError("the fake decode instance dies mid-stream")
                yield b"data: " + orjson.dumps(chunk) + b"\n\n"
                if i == 0 and knobs.gate is not None:
                    assert await asyncio.to_thread(knobs.gate.wait, 10.0), "the gate never opened"
            yield b"data: [DONE]\n\n"
            ended = True
        finally:
            if not ended:
                self.aborted.append(rid)

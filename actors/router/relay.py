"""The claim's answer, relayed to the client: server-sent events as they come, or the JSON.

Events are forwarded as the decode instance sends them, whole: bytes up to the last event
boundary (a blank line, ``\\n\\n``) go out at once, the rest waits for its boundary, so a
decode instance that dies mid-event never leaves the client half an event. The only look
inside is for the end: a stream that stops before ``data: [DONE]`` (the connection broke
or closed) ends with a last ``data: {"error": ...}`` event, then ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

import orjson
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from ringfence.actors.http.errors import ApiError
from ringfence.actors.router.upstream import Stream, TransportError, describe

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class Handover(Protocol):
    """What the relay reads of a request's run (flow.Handover, forward.Forward)."""

    def first_byte(self) -> None: ...

    def decode_failed(self, error: str) -> ApiError: ...

    async def finish(self, outcome: str, status: int) -> None: ...


DONE = b"data: [DONE]\n\n"


class EventRelay(StreamingResponse):
    """The decode instance's event stream for the client. However the response ends (the
    stream's end, the decode instance's failure, the client gone), its handover finishes:
    the upstream stream is closed, so the decode instance aborts a request nobody reads."""

    def __init__(self, handover: Handover, answer: Stream) -> None:
        self.handover = handover
        self.answer = answer
        self.outcome = "client_closed"  # until the stream reached its end
        super().__init__(self._events(), media_type="text/event-stream", headers=SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Relay the events on this task while a second one waits for the client to leave
        and then cancels it. (Starlette's own way, an anyio task group of both, costs a
        streamed answer about a twentieth of the router's CPU.)"""
        relaying = asyncio.current_task()
        assert relaying is not None
        streaming = True

        def client_left(waiter: asyncio.Task[None]) -> None:
            # Only while the events are relayed: after that, the finish below must not be
            # cancelled halfway (the waiter is cancelled then; this is a no-op).
            if waiter.cancelled():
                return
            waiter.exception()  # a wait that failed (retrieved here) ends the answer too
            if streaming:
                relaying.cancel()

        gone = asyncio.ensure_future(self.listen_for_disconnect(receive))
        gone.add_done_callback(client_left)
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not gone.done() or gone.cancelled():
                raise  # the server stopping, not the client
            relaying.uncancel()  # the client left: the answer ends here
        finally:
            streaming = False
            gone.cancel()
            await self.handover.finish(self.outcome, 200)

    async def _events(self) -> AsyncIterator[bytes]:
        pending, done, first = b"", False, True
        try:
            async for chunk in self.answer.chunks():
                if first:
                    self.handover.first_byte()
                    first = False
                pending += chunk
                cut = pending.rfind(b"\n\n") + 2
                if cut >= 2:
                    events, pending = pending[:cut], pending[cut:]
                    done = events.endswith(DONE)
                    yield events
            error = None if done else "its stream ended before data: [DONE]"
        except TransportError as e:
            error = describe(e)
        if error is None:
            self.outcome = "ok"
            if pending:
                yield pending
            return
        self.outcome = "decode_failed"
        failure = self.handover.decode_failed(error)
        yield b"data: " + orjson.dumps(failure.body()) + b"\n\n" + DONE


async def read_whole(handover: Handover, answer: Stream) -> Response:
    """The decode instance's whole answer as the client's; ApiError 502 if it broke."""
    chunks: list[bytes] = []
    try:
        async for chunk in answer.chunks():
            if not chunks:
                handover.first_byte()
            chunks.append(chunk)
    except TransportError as e:
        raise handover.decode_failed(describe(e)) from e
    media_type = answer.headers.get("content-type", "application/json")
    return Response(b"".join(chunks), status_code=answer.status, media_type=media_type)


def is_event_stream(answer: Stream) -> bool:
    media_type: str = answer.headers.get("content-type", "")
    return media_type.startswith("text/event-stream")

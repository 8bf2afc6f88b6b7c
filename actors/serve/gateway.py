"""The event loop's side of the front end: one stream of engine output per HTTP request.

Two threads share the front end's process: the actor's (its driver, which alone talks to
the engine's rings) and the HTTP server's event loop (every request's coroutine). They
meet here, and only here:

- loop -> actor: :meth:`Gateway.open` and :meth:`RequestStream.abort` post a ``Submit``
  or an ``Abort`` to the actor's local inbox (thread-safe, wakes the actor), and
  :meth:`Gateway.reserve` a ``Reserve`` (a decode instance's), answered by a future;
- actor -> loop: the actor hands each engine message for a request to :class:`Handoff`,
  which schedules one drain on the loop however many messages arrive meanwhile.

Every request the front end has in the engine is a :class:`RequestStream` in
:attr:`Gateway.streams`, from ``open`` until the engine's last message for it (or the
actor's word that it is lost): that count is what ``server.max_pending`` bounds, so a
client that went away still counts until the engine let go of its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ringfence.actors.http.errors import ApiError
from ringfence.actors.protocol.client import Abort, Rejected, Reservation, Reserve, Submit, Tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class Lost:
    """The actor's word that a request will get no more output (the engine is gone...)."""

    request_id: str
    error: str
    status: int = 503  # the HTTP status it means: 503 (engine gone), 400 (could not be sent)


Event = Tokens | Rejected | Lost


class Handoff:
    """Calls ``deliver(item)`` in the event loop's thread for each ``put(item)`` from another
    thread, in order, with one wake-up of the loop per batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[object], None]) -> None:
        self._loop = loop
        self._deliver = deliver
        self._lock = threading.Lock()
        self._items: deque[object] = deque()
        self._scheduled = False

    def put(self, item: object) -> None:
        with self._lock:
            self._items.append(item)
            if self._scheduled:
                return
            self._scheduled = True
        with contextlib.suppress(RuntimeError):  # a closed loop: the server stopped
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, deque()
            self._scheduled = False
        for item in items:
            self._deliver(item)


class RequestStream:
    """One request's output as the engine sends it. Used by the request's coroutine."""

    def __init__(self, gateway: Gateway, submit: Submit) -> None:
        self.request_id = submit.request_id
        self.submit = submit
        self._gateway = gateway
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self.opened = time.perf_counter()
        self.done = False  # the engine let go of it (or it is lost): it left the gateway
        self.detached = False  # its client is gone or stopped reading: output is dropped

    def put(self, event: Event) -> None:
        if not self.detached:
            self._events.put_nowait(event)

    async def next(self, timeout: float) -> Event:
        """The next message for this request; TimeoutError after ``timeout`` seconds of none."""
        return await asyncio.wait_for(self._events.get(), timeout)

    def abort(self) -> None:
        """The client does not want the rest: stop it in the engine, drop what still comes.

        The request stays pending until the engine's last message for it arrives.
        Idempotent."""
        if self.detached:
            return
        self.detached = True
        if not self.done:
            self._gateway.post(Abort(request_id=self.request_id))


class Gateway:
    """Open requests and their streams; event-loop thread only, except :meth:`deliver`'s
    caller, the :class:`Handoff`."""

    def __init__(
        self,
        post: Callable[[object], object],
        *,
        max_pending: int,
        retry_after_s: int,
        engine_up: Callable[[], str],
    ) -> None:
        self.post = post  # to the actor's local inbox: any thread
        self.max_pending = max_pending
        self.retry_after_s = retry_after_s
        self._engine_up = engine_up  # "" when the engine takes requests, else why not
        self.streams: dict[str, RequestStream] = {}
        self.reserving: dict[str, asyncio.Future[Reservation | Lost]] = {}  # by reservation id
        self.on_event: Callable[[RequestStream, Event], None] = lambda stream, event: None

    @property
    def pending(self) -> int:
        return len(self.streams)

    def open(self, submit: Submit) -> RequestStream:
        """Send ``submit`` to the engine (through the actor) and return its stream.

        ApiError 429 (with Retry-After) when ``max_pending`` requests are in the engine
        already, 503 when the engine is not taking requests.
        """
        retry = {"Retry-After": str(self.retry_after_s)}
        if len(self.streams) >= self.max_pending:
            raise ApiError(
                f"the server has {len(self.streams)} requests pending, its limit "
                "(server.max_pending): retry later",
                status=429,
                kind="rate_limit_exceeded",
                code="rate_limit_exceeded",
                headers=retry,
            )
        down = self._engine_up()
        if down:
            raise ApiError(
                f"the server cannot take requests now: {down}",
                status=503,
                kind="service_unavailable",
                headers=retry,
            )
        stream = RequestStream(self, submit)
        self.streams[submit.request_id] = stream
        self.post(submit)
        return stream

    def reserve(self, msg: Reserve) -> asyncio.Future[Reservation | Lost]:
        """Send ``msg`` to the engine (through the actor); its answer, or Lost if the engine
        went away first. ApiError 503 when the engine is not taking requests."""
        down = self._engine_up()
        if down:
            raise ApiError(
                f"the server cannot take requests now: {down}",
                status=503,
                kind="service_unavailable",
                code="no_room",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        answer: asyncio.Future[Reservation | Lost] = asyncio.get_running_loop().create_future()
        self.reserving[msg.reservation_id] = answer
        self.post(msg)
        return answer

    def deliver(self, item: object) -> None:
        """Hand one engine message to its request's stream (event-loop thread)."""
        if isinstance(item, Reservation) or (
            isinstance(item, Lost) and item.request_id in self.reserving
        ):
            name = item.reservation_id if isinstance(item, Reservation) else item.request_id
            answer = self.reserving.pop(name, None)
            if answer is not None and not answer.done():
                answer.set_result(item)
            return
        if not isinstance(item, Tokens | Rejected | Lost):
            return
        stream = self.streams.get(item.request_id)
        if stream is None:
            return  # a request already ended (or of an earlier server)
        if not isinstance(item, Tokens) or item.finish_reason:
            del self.streams[item.request_id]
            stream.done = True
        self.on_event(stream, item)
        stream.put(item)

    def lose_all(self, error: str) -> None:
        """End every open request and reservation with ``error`` (the server is stopping)."""
        for request_id in [*self.streams, *self.reserving]:
            self.deliver(Lost(request_id=request_id, error=error))

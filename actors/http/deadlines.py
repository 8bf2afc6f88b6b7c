"""The deadline of a request's head: a connection that has not sent a whole request head
``head_timeout_s`` after it opened (or after the first byte of its next request) is closed.

uvicorn times out only a kept-alive connection that sends nothing; a connection that sends
nothing at all after it opened, or sends its head a byte at a time, is kept for as long as
the client likes, and enough of them hold every socket and file descriptor the server has
(the "slowloris" attack). Its HTTP protocol is therefore subclassed here: a timer starts
when the connection is made and whenever the first bytes of a next request arrive, and is
cancelled when the head is whole (uvicorn then makes the request's cycle and calls the app;
the body's own deadline is :mod:`.limits`'). Nothing else of the protocol changes.

The two deadlines together bound what a slow client holds: a connection no longer than the
head's deadline and the body's, past which it is closed (408 where a body was too slow).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol


def head_deadline(timeout_s: float, base: type[asyncio.Protocol] = AutoHTTPProtocol) -> type:
    """uvicorn's HTTP protocol ``base`` (httptools where installed, else h11) closing a
    connection whose request head does not arrive within ``timeout_s`` (module docstring)."""
    if not timeout_s > 0:
        raise ValueError(f"a head deadline must be > 0 s, got {timeout_s}")

    class HeadDeadline(base):  # type: ignore[valid-type, misc]
        # Set by uvicorn's protocol: the event loop, the transport, and the current request's
        # cycle (None before the first head is whole; then the last one, until the next is).
        loop: asyncio.AbstractEventLoop
        transport: asyncio.Transport
        cycle: Any

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            self._served: Any = None  # the last cycle whose head arrived in time
            self._head_timer: asyncio.TimerHandle | None = None
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and self.cycle is not self._served:
                self._served = self.cycle  # a whole new head: the app has the request now
                self._disarm()
            elif self._awaiting_head() and not self.transport.is_closing():
                self._arm()  # the first bytes of a next request on a kept-alive connection

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _awaiting_head(self) -> bool:
            cycle = self.cycle
            return cycle is None or (cycle is self._served and cycle.response_complete)

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(timeout_s, self._late)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _late(self) -> None:
            self._head_timer = None
            if self._awaiting_head():
                self.transport.close()

    HeadDeadline.__name__ = HeadDeadline.__qualname__ = f"HeadDeadline{base.__name__}"
    return HeadDeadline

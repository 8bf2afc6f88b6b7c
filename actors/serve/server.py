"""uvicorn in a thread of the front end's process, on a socket the actor bound.

The actor binds the socket itself (so that an address in use fails its start, with the
address in the error) and hands it over; uvicorn serves it on an event loop the actor
created, so the actor can schedule work on the loop from the first moment. uvicorn
installs no signal handlers outside the main thread: the supervisor alone decides when
the front end stops (a Stop message), and :meth:`HttpThread.stop` ends the server.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import uvicorn
from starlette.types import ASGIApp

from ringfence.actors.http.deadlines import head_deadline
from ringfence.actors.http.tls import ListenerTls

GRACE_S = 1  # open connections get this long to finish when the server stops
HEAD_TIMEOUT_S = 10.0  # server.header_timeout_s's default


class HttpThread:
    """Serves ``app`` on ``sock`` in a thread running ``loop`` (HTTPS with ``tls``); start
    once, stop once."""

    def __init__(
        self,
        app: ASGIApp,
        sock: socket.socket,
        loop: asyncio.AbstractEventLoop,
        tls: ListenerTls | None = None,
        head_timeout_s: float = HEAD_TIMEOUT_S,
    ) -> None:
        config = uvicorn.Config(
            app,
            http=head_deadline(head_timeout_s),  # a head not whole in time: closed
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=GRACE_S,
            timeout_keep_alive=30,
            **(tls.uvicorn_options() if tls is not None else {}),
        )
        self.server = uvicorn.Server(config)
        self._sock = sock
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="ringfence-http", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self.server.serve(sockets=[self._sock]))
        except BaseException as e:  # reported by stop(); the actor's log has the context
            self.error = e
        finally:
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()
            self._sock.close()

    def stop(self, timeout: float) -> bool:
        """Ask the server to exit and wait up to ``timeout`` s; True if the thread ended."""
        self.server.should_exit = True
        self._thread.join(timeout)
        return not self._thread.is_alive()

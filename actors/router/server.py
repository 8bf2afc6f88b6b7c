"""The router's HTTP server: uvicorn on the main thread's event loop, on a socket bound first.

It speaks HTTPS when the options carry TLS files (``--ssl-certfile``, :mod:`..http.tls`).
The socket is bound before the instances are asked anything, so an address in use fails
the command at once; connections made while the router starts wait in its backlog.
SIGINT and SIGTERM stop the server gracefully (open connections get ``GRACE_S``), and the
command then exits 0: uvicorn's habit of raising the signal again once it stopped (which
would end the process by SIGTERM) is left out.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
from collections.abc import Iterator
from typing import TextIO

import uvicorn

from ringfence.actors.http.deadlines import head_deadline
from ringfence.actors.http.tls import scheme
from ringfence.actors.router.app import build_app
from ringfence.actors.router.log import RouterLog
from ringfence.actors.router.options import RouterOptions
from ringfence.actors.router.state import open_router

GRACE_S = 1  # open connections get this long to finish when the server stops
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    """uvicorn, stopping on SIGINT/SIGTERM without raising the signal again afterwards."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def listen(host: str, port: int) -> socket.socket:
    """A TCP socket listening on ``host:port`` (0: any free port, IPv4 or IPv6 as
    ``host`` says), no Nagle delay; ValueError if it cannot."""
    try:
        sock = socket.create_server((host, port), backlog=1024)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from e
    nodelay(sock)
    return sock


def nodelay(sock: socket.socket) -> None:
    """TCP_NODELAY on a listening socket (its connections inherit it): uvicorn writes an
    answer's head and body apart, and with Nagle's algorithm the body then waits for the
    client's delayed ACK, 40 ms on Linux, on every answer of a kept-alive connection."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def serve(
    options: RouterOptions, sock: socket.socket, *, out: TextIO, log: RouterLog | None = None
) -> None:
    """Start the router (every instance answered, the pool checked: else PoolRefused or
    StartTimeout), tell ``out`` where it listens and that it is ready, and serve until
    SIGINT or SIGTERM."""
    router = await open_router(options, log)
    tls = options.tls
    try:
        config = uvicorn.Config(
            build_app(router),
            http=head_deadline(router.options.header_timeout_s),  # a slow head: closed
            log_level="warning",
            access_log=False,
            proxy_headers=False,  # the router reads no client address: no work a request
            lifespan="off",
            timeout_graceful_shutdown=GRACE_S,
            timeout_keep_alive=30,
            **(tls.uvicorn_options() if tls is not None else {}),
        )
        server = _Server(config)
        host, port = sock.getsockname()[:2]
        router.log.info(
            "router.started", host=host, port=port, tls=tls is not None,
            client_certificates=tls is not None and tls.client_certificates,
            instances=[f"{i.role} {i.describe()}" for i in router.pool.instances],
        )  # fmt: skip
        url = f"{scheme(tls)}://{host}:{port}"
        print(f"ringfence router: listening on {url} (pid {os.getpid()})", file=out)
        print("ringfence router: ready", file=out, flush=True)
        await server.serve(sockets=[sock])
    finally:
        await router.aclose()

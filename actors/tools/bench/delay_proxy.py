"""A TCP proxy that makes a local server remote: each direction's bytes are delivered a
fixed one-way delay after they arrive, and no faster than a given bandwidth.

``bench e2e --remote`` puts one in front of a redis-server on loopback, so the storage tier
costs what it costs across a network (0.5 ms one way: a rack; 2-5 ms: a zone or a region),
which is where the legacy design's lock around storage writes was taken. A bench tool,
never part of the product.

Threads, not an event loop: each direction of each connection has a reader (``recv``, then
the chunk joins a queue with its due time) and a writer (waits on a condition until the
head chunk is due, then ``sendall``). A timed condition wait wakes within tens of
microseconds of its deadline, where an event loop's timers round to epoll's millisecond.
Due times only grow along a direction (the delay is fixed and the link's clock only moves
forward), so a FIFO queue delivers in order. Owned by the thread that enters it.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import threading
import time
from types import TracebackType

CHUNK = 65536  # bytes read at once
WAKE_S = 1.0  # an idle writer's longest wait before it looks whether the proxy closed
JOIN_S = 5.0  # how long closing waits for each thread


class _Direction:
    """One direction of one connection: bytes from ``src`` reach ``dst`` ``delay_s`` after
    they arrived, serialized at ``bandwidth`` bytes/s (None: no limit)."""

    def __init__(
        self, src: socket.socket, dst: socket.socket, delay_s: float, bandwidth: float | None
    ) -> None:
        self.src, self.dst, self.delay_s, self.bandwidth = src, dst, delay_s, bandwidth
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.ready = threading.Condition()
        self.closed = False
        self.link_free = 0.0  # when the link has sent everything queued (bandwidth only)
        self.threads = [
            threading.Thread(target=self._read, daemon=True, name="delay-proxy-read"),
            threading.Thread(target=self._write, daemon=True, name="delay-proxy-write"),
        ]
        for thread in self.threads:
            thread.start()

    def _due(self, size: int) -> float:
        now = time.monotonic()
        if self.bandwidth is None:
            return now + self.delay_s
        self.link_free = max(self.link_free, now) + size / self.bandwidth
        return self.link_free + self.delay_s

    def _read(self) -> None:
        while True:
            try:
                data: bytes | None = self.src.recv(CHUNK)
            except OSError:
                data = b""
            with self.ready:
                self.queue.append((self._due(len(data or b"")), data or None))
                self.ready.notify()
            if not data:  # end of stream (or the proxy closed): the writer passes it on
                return

    def _write(self) -> None:
        while True:
            with self.ready:
                if self.closed:
                    return
                if not self.queue:
                    self.ready.wait(WAKE_S)
                    continue
                due, data = self.queue[0]
                left = due - time.monotonic()
                if left > 0:
                    self.ready.wait(left)  # a later chunk is due later: nothing to re-sort
                    continue
                self.queue.popleft()
            try:
                if data is None:
                    self.dst.shutdown(socket.SHUT_WR)
                    return
                self.dst.sendall(data)
            except OSError:
                return

    def close(self) -> None:
        with self.ready:
            self.closed = True
            self.ready.notify_all()


class DelayProxy:
    """Listens on 127.0.0.1 (a free port) and forwards each connection to ``upstream``,
    delaying each direction by ``one_way_s`` at ``bandwidth`` bytes/s (None: unlimited).
    A context manager: entering starts it, leaving closes every connection and joins its
    threads."""

    def __init__(
        self, upstream: tuple[str, int], *, one_way_s: float, bandwidth: float | None = None
    ) -> None:
        if one_way_s < 0 or (bandwidth is not None and bandwidth <= 0):
            raise ValueError(f"delay {one_way_s} s and bandwidth {bandwidth} B/s must be > 0")
        self.upstream, self.one_way_s, self.bandwidth = upstream, one_way_s, bandwidth
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        self.directions: list[_Direction] = []
        self.lock = threading.Lock()  # sockets and directions: the accept thread adds
        self.acceptor = threading.Thread(target=self._accept, daemon=True, name="delay-proxy")

    def __enter__(self) -> DelayProxy:
        self.acceptor.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            try:
                server = socket.create_connection(self.upstream, timeout=10.0)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                self.sockets += [client, server]
                self.directions += [
                    _Direction(client, server, self.one_way_s, self.bandwidth),
                    _Direction(server, client, self.one_way_s, self.bandwidth),
                ]

    def close(self) -> None:
        """Stop accepting, cut every connection, and join every thread (idempotent)."""
        with contextlib.suppress(OSError):  # wakes the accept (closing alone does not, on Linux)
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        with self.lock:
            directions, sockets = list(self.directions), list(self.sockets)
        for direction in directions:
            direction.close()
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        deadline = time.monotonic() + JOIN_S
        for thread in [self.acceptor, *(t for d in directions for t in d.threads)]:
            if thread.is_alive() or thread.ident is not None:
                thread.join(max(0.0, deadline - time.monotonic()))

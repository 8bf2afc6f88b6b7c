"""The bench's delay proxy (``actors/tools/bench/delay_proxy.py``): bytes pass unchanged and in
order, each direction a one-way delay late and no faster than the bandwidth, and closing it
ends every thread it started. Lower bounds only: a loaded machine may add time, never take
it away."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from ringfence.actors.tools.bench.delay_proxy import DelayProxy


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """A loopback server that sends back whatever each connection sends, until it closes."""
    server = socket.create_server(("127.0.0.1", 0))
    threads = []

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            thread = threading.Thread(target=serve, args=(conn,), daemon=True)
            thread.start()
            threads.append(thread)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    yield server.getsockname()
    server.shutdown(socket.SHUT_RDWR)  # wakes the accept
    server.close()
    acceptor.join(5)
    for thread in threads:
        thread.join(5)


def received(conn: socket.socket, size: int) -> bytes:
    out = b""
    while len(out) < size:
        chunk = conn.recv(size - len(out))
        assert chunk, "the proxy closed the connection early"
        out += chunk
    return out


def test_each_round_trip_takes_at_least_two_one_way_delays_and_keeps_the_bytes(echo) -> None:
    delay = 0.02
    with (
        DelayProxy(echo, one_way_s=delay) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as conn,
    ):
        for i in range(5):
            message = os.urandom(1000 + i)
            start = time.monotonic()
            conn.sendall(message)
            assert received(conn, len(message)) == message
            assert time.monotonic() - start >= 2 * delay


def test_the_bandwidth_spaces_the_bytes_and_order_is_kept(echo) -> None:
    size, bandwidth = 1_000_000, 10e6  # 0.1 s each way at 10 MB/s
    payload = os.urandom(size)
    with (
        DelayProxy(echo, one_way_s=0.0, bandwidth=bandwidth) as proxy,
        socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as conn,
    ):
        start = time.monotonic()
        sender = threading.Thread(target=conn.sendall, args=(payload,))
        sender.start()
        assert received(conn, size) == payload
        sender.join(10)
        assert time.monotonic() - start >= size / bandwidth


def test_closing_ends_every_thread_it_started_even_with_connections_open(echo) -> None:
    before = set(threading.enumerate())
    proxy = DelayProxy(echo, one_way_s=0.001)
    with proxy:
        conns = [socket.create_connection(("127.0.0.1", proxy.port), timeout=10) for _ in range(3)]
        for conn in conns:
            conn.sendall(b"ping")
            assert received(conn, 4) == b"ping"
    left = [t for t in threading.enumerate() if t not in before and t.name.startswith("delay")]
    assert left == []
    for conn in conns:
        assert conn.recv(10) == b"", "the proxy cut the connection"
        conn.close()
    proxy.close()  # again: nothing to do


def test_a_negative_delay_or_bandwidth_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="must be > 0"):
        DelayProxy(("127.0.0.1", 1), one_way_s=-1.0)
    with pytest.raises(ValueError, match="must be > 0"):
        DelayProxy(("127.0.0.1", 1), one_way_s=0.001, bandwidth=0)

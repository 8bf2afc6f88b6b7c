"""What a hostile client meets on the real HTTP server (uvicorn as ``ringfence serve`` and the
router run it, on loopback): a connection that sends no whole head in time is closed, a body
that arrives too slowly is answered 408, one key's calls past its cap are answered 429 while
other keys' are served; an honest client on a kept-alive connection is served throughout."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from ringfence.actors.http.auth import Keys, RequireKey
from ringfence.actors.http.limits import LimitBody
from ringfence.actors.serve.server import HttpThread

HEAD_S, BODY_S = 0.8, 0.8  # the deadlines under test
LIMIT = 4096
CAP = 2  # calls of one key at once


class Body(BaseModel):
    text: str


class Gate:
    """Holds /held calls until opened (from the test's thread)."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.entered = threading.Semaphore(0)


def make_app(gate: Gate) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(body: Body) -> dict[str, int]:
        return {"chars": len(body.text)}

    @app.get("/held")
    async def held() -> dict[str, bool]:
        gate.entered.release()
        opened = await asyncio.get_running_loop().run_in_executor(None, gate.opened.wait, 30.0)
        return {"opened": opened}

    app.add_middleware(LimitBody, max_bytes=LIMIT, timeout_s=BODY_S)
    keys = Keys([("sk-a", ""), ("sk-b", "")])
    app.add_middleware(RequireKey, keys=keys, max_per_key=CAP, option="server.max_requests_per_key")
    return app


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Gate]]:
    gate = Gate()
    sock = socket.create_server(("127.0.0.1", 0))
    http = HttpThread(make_app(gate), sock, asyncio.new_event_loop(), head_timeout_s=HEAD_S)
    http.start()
    host, port = sock.getsockname()[:2]
    try:
        yield f"{host}:{port}", gate
    finally:
        gate.opened.set()
        assert http.stop(10.0)


def connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=10.0)
    return conn


def closed_after(conn: socket.socket, start: float) -> float:
    """Seconds from ``start`` until the server closed ``conn`` (reading what it sent)."""
    while conn.recv(65536):
        pass
    return time.monotonic() - start


def drip(conn: socket.socket, data: bytes, every_s: float, stop: threading.Event) -> int:
    """Send ``data`` a byte every ``every_s`` seconds until sent or the server closes; the
    bytes sent."""
    for sent, byte in enumerate(data):
        try:
            conn.send(bytes([byte]))
        except OSError:  # the server closed the connection
            return sent
        if stop.wait(every_s):
            return sent + 1
    return len(data)


HEAD = b"POST /echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-a\r\n"


def test_a_connection_that_sends_nothing_is_closed_at_the_head_deadline(server):
    address, _ = server
    start = time.monotonic()
    with connect(address) as conn:
        assert HEAD_S * 0.9 <= closed_after(conn, start) < HEAD_S + 5.0


def test_a_head_sent_a_byte_at_a_time_is_cut_off_at_its_deadline(server):
    address, _ = server
    request = HEAD + b"Content-Type: application/json\r\nContent-Length: 13\r\n\r\n"
    stop = threading.Event()
    with connect(address) as conn, ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        sent = pool.submit(drip, conn, request, 0.05, stop)
        elapsed = closed_after(conn, start)
        stop.set()
        assert sent.result(10.0) < len(request)  # the head never got whole
    assert HEAD_S * 0.9 <= elapsed < HEAD_S + 5.0


def test_a_body_sent_a_byte_at_a_time_is_answered_408_at_its_deadline(server):
    address, _ = server
    body = b'{"text": "' + b"x" * 200 + b'"}'
    head = HEAD + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    stop = threading.Event()
    with connect(address) as conn, ThreadPoolExecutor(1) as pool:
        conn.sendall(head)
        start = time.monotonic()
        sent = pool.submit(drip, conn, body, 0.05, stop)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
        elapsed = time.monotonic() - start
        stop.set()
        assert sent.result(10.0) < len(body)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"connection: close" in answer.lower()
    assert b'"code":"request_timeout"' in answer and b"server.body_timeout_s" in answer
    assert BODY_S * 0.9 <= elapsed < BODY_S + 5.0


def test_an_honest_client_is_served_on_one_connection_across_pauses(server):
    address, _ = server
    headers = {"Authorization": "Bearer sk-a"}
    with httpx.Client(base_url=f"http://{address}", headers=headers, timeout=10.0) as client:
        for _ in range(2):
            answer = client.post("/echo", json={"text": "hello"})
            assert answer.status_code == 200 and answer.json() == {"chars": 5}
            threading.Event().wait(HEAD_S * 1.5)  # idle past the head deadline, kept alive
        # A chunked body over the limit is 413, not FastAPI's 400 for a body it could not read.
        chunks = (b'{"text": "' + b"x" * 1000 for _ in range(10))
        answer = client.post("/echo", content=chunks)
        assert answer.status_code == 413, answer.text
        assert answer.json()["error"]["code"] == "request_too_large"


def test_one_keys_calls_past_its_cap_are_429_and_another_keys_are_served(server):
    address, gate = server
    url = f"http://{address}/held"
    a, b = ({"Authorization": f"Bearer {k}"} for k in ("sk-a", "sk-b"))
    with ThreadPoolExecutor(CAP + 1) as pool:
        held = [pool.submit(httpx.get, url, headers=a, timeout=30.0) for _ in range(CAP)]
        for _ in range(CAP):
            assert gate.entered.acquire(timeout=10.0)
        refused = httpx.get(url, headers=a, timeout=10.0)
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        assert "server.max_requests_per_key" in refused.json()["error"]["message"]
        other = pool.submit(httpx.get, url, headers=b, timeout=30.0)
        assert gate.entered.acquire(timeout=10.0)  # another key's call runs
        gate.opened.set()
        assert [f.result(30.0).status_code for f in [*held, other]] == [200] * (CAP + 1)
    assert httpx.get(url, headers=a, timeout=10.0).status_code == 200  # its count went back

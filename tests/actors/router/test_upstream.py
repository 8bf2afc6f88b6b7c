"""The router's HTTP client: what it gives of an answer that breaks off, and how it names
what goes wrong below HTTP."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from ringfence.actors.router.upstream import (
    CallTimeout,
    ConnectError,
    Stream,
    TransportError,
    Upstream,
    describe,
)

EVENTS = b"data: one\n\ndata: two\n\n"
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def server(serve: Serve) -> AsyncIterator[str]:
    """A raw HTTP server on a free loopback port that runs ``serve`` for each connection."""

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        try:
            await serve(reader, writer)
        finally:
            writer.close()

    listening = await asyncio.start_server(connection, "127.0.0.1", 0)
    host, port = listening.sockets[0].getsockname()[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        listening.close()


async def events_then_death(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Two events in one chunk, then the connection's end in the same breath (no last
    chunk): the client reads the events and the end together."""
    writer.write(HEAD + b"%x\r\n" % len(EVENTS) + EVENTS + b"\r\n")
    await writer.drain()


async def stream_ended(stream: Stream, timeout_s: float = 5.0) -> None:
    """Returns once the client saw the stream's connection end, its events unread. Polled:
    aiohttp's reader takes the end with no hook to wait on."""
    content = stream._response.content
    deadline = time.monotonic() + timeout_s
    while content.exception() is None:
        assert time.monotonic() < deadline, "the client did not see the connection end"
        await asyncio.sleep(0.01)


def test_the_bytes_that_came_before_a_stream_broke_off_are_given_before_the_error():
    async def run() -> tuple[list[bytes], BaseException | None]:
        upstream = Upstream()
        got: list[bytes] = []
        try:
            async with server(events_then_death) as url:
                stream = await upstream.open(
                    f"{url}/v1/completions", b"{}", headers={}, connect_s=5, read_s=5
                )
                await stream_ended(stream)
                try:
                    async for chunk in stream.chunks():
                        got.append(chunk)
                except TransportError as e:
                    return got, e
                finally:
                    await stream.aclose()
        finally:
            await upstream.aclose()
        return got, None

    got, error = asyncio.run(run())
    assert b"".join(got) == EVENTS
    assert type(error) is TransportError
    assert describe(error).startswith("TransportError: Response payload is not completed")


def test_a_port_where_nothing_listens_is_a_connect_error():
    async def run() -> None:
        upstream = Upstream()
        listening = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = listening.sockets[0].getsockname()[1]
        listening.close()
        await listening.wait_closed()
        try:
            with pytest.raises(ConnectError):
                await upstream.get(f"http://127.0.0.1:{port}/health", timeout=5)
        finally:
            await upstream.aclose()

    asyncio.run(run())


def test_an_answer_that_does_not_come_in_time_is_a_call_timeout_and_a_timeout_error():
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the client gives up and closes

    async def run() -> None:
        upstream = Upstream()
        try:
            async with server(silent) as url:
                with pytest.raises(CallTimeout) as late:
                    await upstream.post(f"{url}/ringfence/prefill", b"{}", timeout=0.2)
                assert isinstance(late.value, TimeoutError)
                stream_late = upstream.open(
                    f"{url}/v1/completions", b"{}", headers={}, connect_s=5, read_s=0.2
                )
                with pytest.raises(CallTimeout):
                    await stream_late
        finally:
            await upstream.aclose()

    asyncio.run(run())

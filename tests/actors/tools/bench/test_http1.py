"""The bench's bare HTTP/1.1 client (actors/tools/bench/serving/http1.py) against a server
that answers exactly the bytes a test gives: chunked and sized bodies, a kept-alive
connection the server closed while idle, and answers it cannot read, named."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from ringfence.actors.tools.bench.serving.http1 import Answer, BadAnswer, Connection

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def with_server(handler: Handler, test: Callable[[str], Awaitable[None]]) -> None:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        await test(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    finally:
        server.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return await reader.readexactly(length)


def test_the_client_reads_a_chunked_answer_and_then_reopens_a_closed_connection():
    answers = [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2;x=y\r\nde\r\n0\r\n\r\n",
        b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok",
    ]
    bodies: list[bytes] = []

    async def one_answer_a_connection(reader, writer) -> None:
        bodies.append(await read_request(reader))
        writer.write(answers[len(bodies) - 1])
        await writer.drain()
        writer.close()  # the server ends a kept-alive connection while it is idle

    async def test(url: str) -> None:
        connection = Connection(url)
        assert await connection.post("/a", b'{"n":1}') == Answer(200, b"abcde")
        assert await connection.post("/b", b'{"n":2}') == Answer(201, b"ok")
        assert connection.opened == 2
        connection.close()

    asyncio.run(with_server(one_answer_a_connection, test))
    assert bodies == [b'{"n":1}', b'{"n":2}']


@pytest.mark.parametrize(
    "answer, error",
    [(b"SMTP ready\r\n\r\n", "not an HTTP/1.1 status line"),
     (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n", "a bad chunk size line"),
     (b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nshort", "the connection ended 5 bytes")],
)  # fmt: skip
def test_an_answer_the_client_cannot_read_is_a_bad_answer_naming_why(answer, error):
    async def garbage(reader, writer) -> None:
        await read_request(reader)
        writer.write(answer)
        await writer.drain()
        writer.close()

    async def test(url: str) -> None:
        connection = Connection(url)
        with pytest.raises(BadAnswer, match=error):
            await connection.post("/", b"{}")

    asyncio.run(with_server(garbage, test))

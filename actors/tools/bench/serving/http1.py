"""A bare HTTP/1.1 client for timing requests: kept-alive connections, one request at a time
on each, nothing read of an answer but its status line, the headers that frame its body,
and its body.

Why not httpx, as the other serving benchmarks use: measured here (2 CPUs),
an ``httpx.AsyncClient`` took 1.1 ms at p50 for a small POST that a stub instance answers in
0.18 ms over a bare socket (``httpx.Client``: 0.66 ms). A benchmark of a 2 ms budget would
read mostly its own client and that client's scatter; this one adds tens of microseconds.

Framing: a request carries ``content-length``; an answer's body is framed by
``content-length``, by the chunked transfer coding (a streamed answer), or by the end of the
connection. An answer that says ``connection: close`` closes the connection, and the next
request opens another; so does a kept-alive connection the server closed while it was idle
(the request is sent again once, on a new connection, if no byte of its answer came).
"""

from __future__ import annotations

import asyncio
from typing import Final, NamedTuple
from urllib.parse import urlsplit

from ringfence.shm.errors import RingfenceError

HEAD_END: Final = b"\r\n\r\n"
LINE_END: Final = b"\r\n"
LIMIT: Final = 1 << 20  # the longest head or chunk-size line read


class BadAnswer(RingfenceError, ConnectionError):
    """The server's answer is not HTTP/1.1 this client can read (the message says how)."""


class Answer(NamedTuple):
    status: int
    body: bytes  # de-chunked


class Connection:
    """One kept-alive connection to ``base`` (``http://host:port``), opened on first use.
    Used from one task at a time; ``close()`` is idempotent."""

    def __init__(self, base: str) -> None:
        split = urlsplit(base)
        if split.scheme != "http" or split.hostname is None or split.port is None:
            raise ValueError(f"{base!r}: an http://host:port URL is needed")
        self.host, self.port = split.hostname, split.port
        self._host_header = split.netloc.encode()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self.opened = 0  # connections opened so far

    async def post(self, path: str, body: bytes) -> Answer:
        """POST ``body`` (JSON) to ``path``; the answer, read whole. ConnectionError (OSError)
        or BadAnswer when it fails; the connection is closed then."""
        head = b"POST %s HTTP/1.1\r\nhost: %s\r\n" % (path.encode(), self._host_header)
        head += b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
        reused = self._writer is not None
        try:
            try:
                return await self._exchange(head + body)
            except asyncio.IncompleteReadError as e:
                if not (reused and not e.partial):
                    raise
            self.close()  # the server closed it while idle: once more, on a new connection
            return await self._exchange(head + body)
        except asyncio.IncompleteReadError as e:
            self.close()
            raise BadAnswer(f"the connection ended {len(e.partial)} bytes into a read") from e
        except BaseException:
            self.close()
            raise

    async def _exchange(self, request: bytes) -> Answer:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(
                self.host, self.port, limit=LIMIT
            )
            self.opened += 1
        assert self._reader is not None
        self._writer.write(request)
        raw = await self._reader.readuntil(HEAD_END)
        status, headers = _head(raw)
        body = await self._body(self._reader, headers)
        if headers.get(b"connection", b"").lower() == b"close":
            self.close()
        return Answer(status, body)

    @staticmethod
    async def _body(reader: asyncio.StreamReader, headers: dict[bytes, bytes]) -> bytes:
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            parts: list[bytes] = []
            while True:
                line = await reader.readuntil(LINE_END)
                try:
                    size = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    raise BadAnswer(f"a bad chunk size line {line[:40]!r}") from None
                if size == 0:
                    await reader.readuntil(LINE_END)  # no trailers are sent to a client
                    return b"".join(parts)
                parts.append((await reader.readexactly(size + 2))[:-2])
        length = headers.get(b"content-length")
        if length is None:
            return await reader.read()
        return await reader.readexactly(int(length))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


def _head(raw: bytes) -> tuple[int, dict[bytes, bytes]]:
    """The status and the headers (names in lower case) of an answer's head."""
    lines = raw[: -len(HEAD_END)].split(LINE_END)
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise BadAnswer(f"not an HTTP/1.1 status line: {lines[0][:80]!r}")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers

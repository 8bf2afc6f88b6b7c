"""The router's HTTP client for its calls to the instances: one aiohttp session a router.

aiohttp, not httpx: a call costs the router about 0.18 ms of CPU on aiohttp's
``ClientSession`` against about 1 ms on httpx's ``AsyncClient`` (RESULTS.md, "What the
router adds"), and the router makes one to three calls a request. One session, kept open
from the router's start to its close, holds a pool of kept-alive connections to every
instance; it keeps no cookies and reads no proxy settings (instances are reached directly).

Every call has a deadline: a whole answer's (``timeout``, the call and its body), or a
stream's (``connect_s`` to connect, ``read_s`` between two reads of its body). What goes
wrong below HTTP is a :class:`TransportError`, named for what happened
(:class:`ConnectError`: nothing could be sent; :class:`CallTimeout`: the deadline passed;
:class:`TlsRefused`: the TLS handshake failed, an instance's certificate did not verify;
the base class: the answer broke off), never aiohttp's own errors; an HTTP answer, whatever
its status, is an :class:`Answer` or a :class:`Stream`.

Owned by the router's event loop: the session is made and used on it only.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import orjson

from ringfence.shm.errors import RingfenceError

JSON = {"Content-Type": "application/json"}
# Streams are long-lived: one connection for each request in flight, at most this many.
MAX_CONNECTIONS = 4096
# An idle connection is kept for reuse this long: less than an instance keeps it
# (``ringfence serve``: 30 s), so the router closes it first and never sends a request on
# a connection the instance is closing (a POST is not sent again).
KEEPALIVE_S = 20.0
DEFAULT_TIMEOUT_S = 30.0  # a call that names no deadline (each of the router's names one)
CONNECT_S = 5.0


class TransportError(RingfenceError, ConnectionError):
    """No HTTP answer came, or its body broke off (the instance died, closed the
    connection, or sent what is not HTTP); the message says what aiohttp saw."""


class ConnectError(TransportError):
    """The instance could not be connected to (refused, unreachable): nothing was sent."""


class TlsRefused(ConnectError):
    """The TLS handshake with the instance failed: its certificate did not verify (another
    CA's, or for another host name), or it does not speak TLS. Asking again changes nothing."""


class CallTimeout(TransportError, TimeoutError):
    """The call's deadline passed (to connect, to answer, or between two reads)."""


def transport_error(e: BaseException) -> TransportError:
    """aiohttp's (or asyncio's) error ``e`` as the router's."""
    text = str(e) or type(e).__name__
    if isinstance(e, TimeoutError):  # aiohttp's timeouts are TimeoutErrors too
        return CallTimeout(text)
    if isinstance(e, aiohttp.ClientConnectorCertificateError):
        reason = getattr(e.certificate_error, "verify_message", "") or str(e.certificate_error)
        return TlsRefused(f"its TLS certificate does not verify: {reason}")
    if isinstance(e, aiohttp.ClientConnectorSSLError):
        return TlsRefused(f"the TLS handshake failed: {e.os_error}")
    if isinstance(e, aiohttp.ClientConnectorError):
        return ConnectError(text)
    return TransportError(text)


# What an aiohttp call raises below HTTP (a total deadline passing: a bare TimeoutError).
FAILURES = (aiohttp.ClientError, TimeoutError)


def describe(e: BaseException) -> str:
    """``ConnectError: Cannot connect to host ...``: for logs and error messages."""
    return f"{type(e).__name__}: {e}"


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole HTTP answer: its status, headers (case-insensitive) and body."""

    url: str  # where the call went
    status: int
    headers: Mapping[str, str]
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON (ValueError if it is not)."""
        return orjson.loads(self.content)


class Stream:
    """An answer whose body is read as it comes (:meth:`chunks`, or :meth:`read` whole),
    then :meth:`aclose`\\ d once read or abandoned."""

    def __init__(self, url: str, response: aiohttp.ClientResponse) -> None:
        self.url = url
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers
        self._response = response

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; TransportError if it broke off (its end
        before the length or the last chunk the answer announced included), once every
        byte that came before the break was given."""
        content = self._response.content
        try:
            async for chunk in content.iter_any():
                yield chunk
        except FAILURES as e:
            left = arrived(content)
            if left:
                yield left
            raise transport_error(e) from e

    async def read(self) -> bytes:
        """The whole body (TransportError if it broke off); the answer is closed then."""
        try:
            return b"".join([chunk async for chunk in self.chunks()])
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Done with the answer. Idempotent. A body read to its end leaves the connection
        in the pool; one not read to its end (a client gone mid-stream) closes it, so the
        instance sees the call go and aborts its request."""
        response = self._response
        if response.content.is_eof():
            response.release()
        else:
            response.close()


def arrived(content: aiohttp.StreamReader) -> bytes:
    """The bytes of a broken body that arrived and were not read yet. aiohttp's reader raises
    the failure before them (``readany`` looks at its exception first), so what an instance
    sent just before it died (the events of a stream, in the same read as the connection's
    end) would be lost: they are taken from its buffer, a private field."""
    if not getattr(content, "_buffer", None):
        return b""
    return content._read_nowait(-1)


class Upstream:
    """The router's one HTTP client (see the module docstring)."""

    def __init__(self, key: str = "", tls: ssl.SSLContext | None = None) -> None:
        """``key``: the instances' API key, presented on every call (none if empty);
        ``tls``: the context of https instance URLs (:func:`..http.tls.instance_context`;
        None: aiohttp's default, which verifies against the system's trust store)."""
        self._tls = tls if tls is not None else ssl.create_default_context()
        connector = aiohttp.TCPConnector(
            limit=MAX_CONNECTIONS,
            limit_per_host=0,
            keepalive_timeout=KEEPALIVE_S,
            ssl=self._tls,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=DEFAULT_TIMEOUT_S, sock_connect=CONNECT_S),
            cookie_jar=aiohttp.DummyCookieJar(),  # one client's cookie is no other's
            trust_env=False,
            headers={"Authorization": f"Bearer {key}"} if key else None,
        )

    async def closed_after_handshake(self, url: str, *, timeout: float) -> bool:
        """Whether the https instance at ``url`` completes a TLS handshake with the router and
        then closes the connection without answering a request. An instance that asks for a
        client certificate the router did not present does this under TLS 1.3 (the refusal
        comes after the handshake, as an alert aiohttp reports as "Server disconnected"); a
        server asked again will do it again."""
        parts = urlsplit(url)
        if parts.scheme != "https" or parts.hostname is None:
            return False
        host, port = parts.hostname, parts.port or 443
        request = b"GET /health HTTP/1.1\r\nHost: %s\r\n\r\n" % parts.netloc.encode()

        def ask() -> bool:
            try:
                raw = socket.create_connection((host, port), timeout=timeout)
            except OSError:  # refused, unreachable, timed out: nothing said of TLS
                return False
            with raw:
                try:
                    tls = self._tls.wrap_socket(raw, server_hostname=host)
                except OSError:  # the handshake failed: aiohttp names that itself
                    return False
                with tls:
                    try:
                        tls.sendall(request)
                        return tls.recv(1) == b""
                    except (ConnectionResetError, ssl.SSLError):
                        return True
                    except OSError:
                        return False

        return await asyncio.to_thread(ask)

    async def get(self, url: str, *, timeout: float) -> Answer:
        """``GET url``, its whole answer within ``timeout`` seconds."""
        return await self._call("GET", url, None, None, timeout)

    async def post(
        self, url: str, body: bytes, *, timeout: float, headers: Mapping[str, str] = JSON
    ) -> Answer:
        """``POST body`` to ``url`` (JSON unless ``headers`` say), its whole answer within
        ``timeout`` seconds."""
        return await self._call("POST", url, body, headers, timeout)

    async def _call(
        self,
        method: str,
        url: str,
        body: bytes | None,
        headers: Mapping[str, str] | None,
        timeout: float,
    ) -> Answer:
        try:
            async with self._session.request(
                method, url, data=body, headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:  # fmt: skip
                content = await response.read()
                return Answer(url, response.status, response.headers, content)
        except FAILURES as e:
            raise transport_error(e) from e

    async def open(
        self,
        url: str,
        body: bytes,
        *,
        headers: Mapping[str, str],
        connect_s: float,
        read_s: float,
    ) -> Stream:
        """``POST body`` to ``url``: its answer once its head came, the body unread (no
        deadline for the whole: ``read_s`` between two reads)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_s, sock_read=read_s)
        try:
            response = await self._session.post(url, data=body, headers=headers, timeout=timeout)
        except FAILURES as e:
            raise transport_error(e) from e
        return Stream(url, response)

    async def aclose(self) -> None:
        """Close every connection. Idempotent."""
        await self._session.close()

"""API keys: who may call ``ringfence serve`` and ``ringfence router``.

Keys come from three places, all of them taken: the ``server.api_key`` setting (a secret:
``ringfence serve`` moves it into the environment before anything is spawned, and the run
dir's config.toml holds it empty, :mod:`ringfence.runtime.secrets`), the environment
variable ``RINGFENCE_API_KEY`` (vLLM's ``VLLM_API_KEY``; several keys comma-separated), and a
key file (``server.api_key_file``: one key a line, blank lines and ``#`` comments skipped),
for keys that must sit in neither a config nor an environment.

With any key set, every route asks for ``Authorization: Bearer <key>`` but ``/health`` (a
liveness probe has no key) and ``/metrics`` (unless ``server.protect_metrics``): a call without
one, or with another, gets 401 in OpenAI's error body, before the route reads its body, and
changes nothing. A key is compared as its SHA-256 digest with ``hmac.compare_digest``,
against every key held, so the time taken tells nothing of a key's length or of how much of
it matched. Keys are never logged: a refused call is counted, not recorded with what it sent.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from ringfence.actors.serve.api import error_body, send_error
from ringfence.actors.serve.config import API_KEY_ENV, INSTANCE_KEY_ENV
from ringfence.runtime.secrets import secret_values

OPEN_PATHS = frozenset({"/health"})  # and /metrics unless protected


def read_key_file(path: str) -> list[str]:
    """The keys of a key file; ValueError naming the file if it cannot be read or holds none."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"api key file {path}: {getattr(e, 'strerror', None) or e}") from None
    keys = [line.strip() for line in text.splitlines()]
    keys = [k for k in keys if k and not k.startswith("#")]
    if not keys:
        raise ValueError(f"api key file {path}: no key in it (one a line)")
    return keys


def load_keys(inline: str = "", key_file: str = "", env: str = API_KEY_ENV) -> Keys:
    """Every key of the three places (module docstring); :class:`Keys` with none: no check."""
    keys = secret_values(inline, env)
    if key_file:
        keys += read_key_file(key_file)
    for key in keys:
        if any(c.isspace() or not c.isprintable() for c in key):
            raise ValueError("an API key holds a space or an unprintable character")
    return Keys(keys)


def instance_key(key_file: str = "") -> str:
    """The one key ``ringfence router`` presents to its instances: the key file's, else
    ``RINGFENCE_INSTANCE_API_KEY``'s ("" for none); ValueError if there are several."""
    keys = read_key_file(key_file) if key_file else secret_values("", INSTANCE_KEY_ENV)
    if len(keys) > 1:
        where = key_file or INSTANCE_KEY_ENV
        raise ValueError(f"{where}: the router presents one key to its instances, not {len(keys)}")
    return keys[0] if keys else ""


class Keys:
    """The keys a server takes (their digests only)."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = tuple(dict.fromkeys(_digest(k.encode()) for k in keys))

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:  # never the keys
        return f"Keys({len(self._digests)} keys)"

    def accepts(self, authorization: bytes | None) -> bool:
        """Whether an ``Authorization`` header's value is ``Bearer`` and one of the keys."""
        if authorization is None:
            return False
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        digest = _digest(token.strip())
        found = False
        for held in self._digests:  # every one, whatever matched: the same time for all
            found |= hmac.compare_digest(digest, held)
        return found


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


UNAUTHORIZED = orjson.dumps(
    error_body(
        "a valid API key is required: send 'Authorization: Bearer <key>'",
        kind="invalid_request_error",
        code="invalid_api_key",
        param=None,
    )
)


@dataclass(frozen=True, slots=True)
class RequireKey:
    """ASGI middleware: 401 for an HTTP call to a protected path without a key of ``keys``."""

    app: ASGIApp
    keys: Keys
    open_paths: frozenset[str] = OPEN_PATHS

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
                break
        if self.keys.accepts(authorization):
            await self.app(scope, receive, send)
            return
        await send_error(send, 401, UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])


def open_paths(protect_metrics: bool) -> frozenset[str]:
    """The paths that need no key."""
    return OPEN_PATHS if protect_metrics else OPEN_PATHS | {"/metrics"}


def exposed_without_key(host: str, keys: Keys) -> bool:
    """Whether a server on ``host`` with ``keys`` answers anyone beyond this machine."""
    return not keys and beyond_loopback(host)


def keys_in_clear(host: str, keys: Keys, tls: bool) -> bool:
    """Whether a server on ``host`` asks for ``keys`` beyond this machine over plain HTTP,
    where anyone on the path reads them."""
    return bool(keys) and not tls and beyond_loopback(host)


def beyond_loopback(host: str) -> bool:
    """Whether an address to listen on lets other machines in."""
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host != "localhost"


def exposed_warning(command: str, host: str, port: int) -> str:
    return (
        f"ringfence {command}: warning: listening on {host}:{port} with no API key: anyone who "
        f"can reach it may use it (give it keys: {API_KEY_ENV}, or a key file)"
    )


def clear_keys_warning(command: str, host: str, port: int, flags: str) -> str:
    return (
        f"ringfence {command}: warning: listening on {host}:{port} over plain HTTP with API "
        f"keys: they travel in clear, readable on the way (give it a certificate: {flags})"
    )

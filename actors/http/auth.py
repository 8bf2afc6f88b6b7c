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

Each key belongs to a tenant: the name after it on its key-file line (``<key> <tenant>``:
keys of one name are one tenant), else one of its own, ``key-`` and 16 hex digits of a
BLAKE2b digest of the key (a one-way name, the same on every server given the key). With
``server.salt_by_key`` (``--salt-by-key`` on the router) the tenant's salt salts every
request made with the key (:func:`tenant_salt`): tenants share no cached prefix, and cannot
learn from a short first token that another sent one, unless an operator gives their keys
one tenant name. A tenant's salt is one only its keys make: a key's own name, or a named
tenant's name and a BLAKE2b digest of all its keys (so the block hashes in KV events or a
shared tier's key names cannot be matched against a guessed prompt under a guessed tenant
name). It is the same on every server given the same key file; a named tenant given another
key gets a new salt, and finds its earlier prefixes no more.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from ringfence.actors.http.env import API_KEY_ENV, INSTANCE_KEY_ENV
from ringfence.actors.http.errors import error_body, send_error
from ringfence.runtime.secrets import secret_values

OPEN_PATHS = frozenset({"/health"})  # and /metrics unless protected
TENANT_SCOPE = "ringfence.tenant"  # the ASGI scope key RequireKey sets: the tenant's salt


def read_key_file(path: str) -> list[tuple[str, str]]:
    """The ``(key, tenant)`` lines of a key file ("" for a line naming no tenant); ValueError
    naming the file (and line) if it cannot be read, holds none or a line is not one."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"api key file {path}: {getattr(e, 'strerror', None) or e}") from None
    keys: list[tuple[str, str]] = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) > 2:
            raise ValueError(
                f"api key file {path}, line {number}: a key and at most a tenant name, "
                f"not {len(words)} words"
            )
        keys.append((words[0], words[1] if len(words) == 2 else ""))
    if not keys:
        raise ValueError(f"api key file {path}: no key in it (one a line)")
    return keys


def load_keys(inline: str = "", key_file: str = "", env: str = API_KEY_ENV) -> Keys:
    """Every key of the three places (module docstring); :class:`Keys` with none: no check."""
    keys = [(k, "") for k in secret_values(inline, env)]
    if key_file:
        keys += read_key_file(key_file)
    for key, tenant in keys:
        if any(c.isspace() or not c.isprintable() for c in key + tenant):
            raise ValueError("an API key or tenant name holds a space or an unprintable character")
    return Keys(keys)


class KeySettings(Protocol):
    """What :func:`server_keys` reads of a server's settings (``serve``'s ``[server]``)."""

    @property
    def api_key(self) -> str: ...
    @property
    def api_key_file(self) -> str: ...
    @property
    def salt_by_key(self) -> bool: ...


def server_keys(server: KeySettings) -> Keys:
    """The keys of ``serve``'s ``[server]`` settings; ValueError for a key file that cannot be
    read, or for salting by key with no key to salt by."""
    keys = load_keys(server.api_key, server.api_key_file)
    if server.salt_by_key and not keys:
        raise ValueError(
            f"server.salt_by_key salts requests by their API key, and no key is set (give "
            f"{API_KEY_ENV}, server.api_key or server.api_key_file)"
        )
    return keys


def instance_key(key_file: str = "") -> str:
    """The one key ``ringfence router`` presents to its instances: the key file's, else
    ``RINGFENCE_INSTANCE_API_KEY``'s ("" for none); ValueError if there are several."""
    if key_file:
        keys = [key for key, _ in read_key_file(key_file)]
    else:
        keys = secret_values("", INSTANCE_KEY_ENV)
    if len(keys) > 1:
        where = key_file or INSTANCE_KEY_ENV
        raise ValueError(f"{where}: the router presents one key to its instances, not {len(keys)}")
    return keys[0] if keys else ""


class Keys:
    """The keys a server takes (their digests only), each with its tenant's name and salt."""

    def __init__(self, keys: Sequence[str | tuple[str, str]]) -> None:
        tenants: dict[bytes, str] = {}
        named: dict[bytes, bool] = {}
        for item in keys:
            key, tenant = (item, "") if isinstance(item, str) else item
            digest = _digest(key.encode())
            named[digest] = bool(tenant) or named.get(digest, False)
            tenants[digest] = tenant or tenants.get(digest) or _own_tenant(digest)
        members: dict[str, list[bytes]] = {}
        for digest, tenant in tenants.items():
            members.setdefault(tenant, []).append(digest)
        self._digests = tuple(tenants)
        self._tenants = tuple(tenants.values())
        self._salts = tuple(
            _named_salt(tenant, members[tenant]) if named[digest] else tenant
            for digest, tenant in tenants.items()
        )

    def __bool__(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:  # never the keys
        return f"Keys({len(self._digests)} keys)"

    def accepts(self, authorization: bytes | None) -> bool:
        """Whether an ``Authorization`` header's value is ``Bearer`` and one of the keys."""
        return self.tenant(authorization) is not None

    def tenant(self, authorization: bytes | None) -> str | None:
        """The tenant of the key an ``Authorization`` header's value presents (``Bearer``),
        None if it is none of the keys."""
        index = self.index(authorization)
        return None if index is None else self._tenants[index]

    def index(self, authorization: bytes | None) -> int | None:
        """Which key an ``Authorization`` header's value presents (``Bearer``), None if none."""
        if authorization is None:
            return None
        scheme, _, token = authorization.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        digest = _digest(token.strip())
        found = -1
        for index, held in enumerate(self._digests):  # every one, whatever matched: the
            if hmac.compare_digest(digest, held):  # same comparisons for all
                found = index
        return found if found >= 0 else None

    def salt_of(self, index: int) -> str:
        """The salt of key ``index``'s tenant (module docstring)."""
        return self._salts[index]


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def _own_tenant(digest: bytes) -> str:
    """The tenant of a key given no name: a one-way name of its own (module docstring)."""
    return "key-" + hashlib.blake2b(digest, digest_size=8, person=b"ringfence.tenant").hexdigest()


def _named_salt(tenant: str, digests: list[bytes]) -> str:
    """A named tenant's salt: its name and a digest of all its keys' digests."""
    digest = hashlib.blake2b(tenant.encode(), digest_size=8, person=b"ringfence.salt")
    for held in sorted(digests):
        digest.update(held)
    return f"{tenant}-{digest.hexdigest()}"


def tenant_salt(tenant: str | None, cache_salt: str | None, salt_by_key: bool) -> str:
    """The cache salt a request runs with: the client's ``cache_salt``, under the caller's
    tenant's salt (``tenant``: :meth:`Keys.salt_of`) when salting by key. A tenant's salt
    holds no space, so the first space ends it, and no client's salt can make another
    tenant's."""
    salt = cache_salt or ""
    if not salt_by_key or tenant is None:
        return salt
    return f"{tenant} {salt}" if salt else tenant


UNAUTHORIZED = orjson.dumps(
    error_body(
        "a valid API key is required: send 'Authorization: Bearer <key>'",
        kind="invalid_request_error",
        code="invalid_api_key",
        param=None,
    )
)


def too_many(limit: int, option: str) -> bytes:
    return orjson.dumps(
        error_body(
            f"this API key has {limit} requests running already ({option}); retry later",
            kind="rate_limit_exceeded",
            code="rate_limit_exceeded",
            param=None,
        )
    )


@dataclass(frozen=True, slots=True)
class RequireKey:
    """ASGI middleware: 401 for an HTTP call to a protected path without a key of ``keys``;
    429 for one past ``max_per_key`` calls of its key running at once (0: no cap), each
    running from its head until its answer ended (a stream's last event)."""

    app: ASGIApp
    keys: Keys
    open_paths: frozenset[str] = OPEN_PATHS
    max_per_key: int = 0
    option: str = "server.max_requests_per_key"  # what the 429 names
    retry_after_s: int = 1
    running: dict[int, int] = field(default_factory=dict)  # key index -> calls running

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
                break
        index = self.keys.index(authorization)
        if index is None:
            await send_error(send, 401, UNAUTHORIZED, [(b"www-authenticate", b"Bearer")])
            return
        scope[TENANT_SCOPE] = self.keys.salt_of(index)
        running = self.running.get(index, 0)
        if self.max_per_key and running >= self.max_per_key:
            retry = [(b"retry-after", b"%d" % self.retry_after_s)]
            await send_error(send, 429, too_many(self.max_per_key, self.option), retry)
            return
        self.running[index] = running + 1
        try:
            await self.app(scope, receive, send)
        finally:
            left = self.running[index] - 1
            if left:
                self.running[index] = left
            else:
                del self.running[index]


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

"""The storage backends by name, and the one way to open the tier a run's settings name.

A backend is a module (a class that follows :class:`~ringfence.cache.storage.StorageBackend`)
and one entry of :data:`BACKENDS`: its opener, whether instances can share one tier of it,
and the client library it needs. ``cache.storage.backend`` takes exactly the registry's
names (``ringfence.cache.config``), the engine's launch checks read the entry (a role that
hands KV over needs a shared tier; a client library must be installed), and every actor
opens its tier through :func:`open_storage`, so nothing else names a backend.

Imports no backend module: each opener imports its own when it is called (the redis
client only where the redis backend is used).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final, Protocol

from ringfence.cache.storage.backend import DEFAULT_TIMEOUT_S, StorageBackend, StorageLog
from ringfence.cache.storage.blob import check_key
from ringfence.cache.storage.seal import Seal, load_seal
from ringfence.cache.storage.url import password_of
from ringfence.shm.errors import ConfigError

RUN_STORAGE = "storage"  # under the run dir: where a tier of this run only keeps its blocks
NO_TIER: Final = "none"  # the backend that turns the storage tier off: nothing is kept


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Place:
    """Where and how a backend stores: the ``cache.storage`` settings an opener gets."""

    path: str  # local: the directory (the run's own when the settings leave it empty)
    url: str  # redis: the server
    max_bytes: int  # local, memory: the bound (0: none)
    timeout_s: float  # redis: the connect and reply timeout
    require_server: bool  # redis: an unreachable server at open raises (else: a warning)
    seal: Seal | None = None  # the storage secret's MAC, where one is set: every blob keyed
    password: str = ""  # redis: the server's password (never in the URL)


# (fingerprint, place, log) -> the backend; an opener imports its backend's module.
Opener = Callable[[bytes, Place, StorageLog | None], StorageBackend]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Backend:
    """One registered backend: how it opens, and what the launch checks ask of it."""

    open: Opener
    # Whether instances (other processes, other machines) can use one tier of it, as a
    # prefill and a decode instance must; and how, as the role check advises it.
    shared: bool
    how_shared: str = ""
    # Whether an empty ``cache.storage.path`` means ``<run dir>/storage``: a tier of this
    # run only, which no other instance reads.
    path_in_run_dir: bool = False
    requires: str = ""  # the module of its client library (a key of runtime.extras'), or ""


class StorageSettings(Protocol):
    """The ``[cache.storage]`` settings :func:`open_storage` reads (``cache.config``'s
    ``StorageConfig``)."""

    @property
    def backend(self) -> str: ...
    @property
    def path(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def max_bytes(self) -> int: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def password(self) -> str: ...
    @property
    def secret(self) -> str: ...
    @property
    def secret_file(self) -> str: ...


def _open_local(fp: bytes, place: Place, log: StorageLog | None) -> StorageBackend:
    from ringfence.cache.storage.local import LocalBackend

    if not place.path:
        raise ConfigError(
            "cache.storage.path: the local backend needs a directory", key="cache.storage.path"
        )
    return LocalBackend(
        place.path, fingerprint=fp, max_bytes=place.max_bytes, log=log, seal=place.seal
    )


def _open_redis(fp: bytes, place: Place, log: StorageLog | None) -> StorageBackend:
    from ringfence.cache.storage.redis_backend import RedisBackend

    if not place.url:
        raise ConfigError(
            "cache.storage.url: the redis backend needs a URL", key="cache.storage.url"
        )
    return RedisBackend(
        place.url,
        fingerprint=fp,
        log=log,
        socket_timeout_s=place.timeout_s,
        require_server=place.require_server,
        seal=place.seal,
        password=place.password,
    )


def _open_memory(fp: bytes, place: Place, log: StorageLog | None) -> StorageBackend:
    from ringfence.cache.storage.memory import MemoryBackend

    return MemoryBackend(fingerprint=fp, max_bytes=place.max_bytes, log=log, seal=place.seal)


def _open_none(fp: bytes, place: Place, log: StorageLog | None) -> StorageBackend:
    from ringfence.cache.storage.memory import NullBackend

    return NullBackend()


_A_DIRECTORY = "a directory every instance of the pair uses (cache.storage.path)"
# The registry, in the order the config lists the names. A new backend is a module and a line.
BACKENDS: Final[dict[str, Backend]] = {
    "local": Backend(open=_open_local, shared=True, how_shared=_A_DIRECTORY, path_in_run_dir=True),
    "redis": Backend(
        open=_open_redis, shared=True, how_shared="the server's cache.storage.url", requires="redis"
    ),
    "memory": Backend(open=_open_memory, shared=False),
    NO_TIER: Backend(open=_open_none, shared=False),
}
BACKEND_NAMES: Final = tuple(BACKENDS)  # cache.storage.backend's choices


def backend(name: str) -> Backend:
    """The registry's entry of ``name``; ConfigError naming the key and the known names."""
    if name not in BACKENDS:
        known = ", ".join(repr(n) for n in BACKENDS)
        raise ConfigError(
            f"cache.storage.backend: must be one of {known}, got {name!r}",
            key="cache.storage.backend",
        )
    return BACKENDS[name]


def open_storage(
    settings: StorageSettings,
    *,
    fingerprint: bytes,
    run_dir: str | os.PathLike[str] | None,
    log: StorageLog | None = None,
    require_server: bool = True,
) -> StorageBackend:
    """The storage tier ``settings`` (``[cache.storage]``) name, opened under ``fingerprint``.

    A backend whose registry entry puts an empty ``path`` in the run dir keeps its blocks
    in ``<run_dir>/storage`` (with no ``run_dir``, the path stays empty and the backend
    refuses it). The storage secret is the settings' and the environment's
    (:func:`.seal.load_seal`). The rest is :func:`open_backend`'s.
    """
    path = settings.path
    if not path and backend(settings.backend).path_in_run_dir and run_dir is not None:
        path = str(Path(run_dir) / RUN_STORAGE)
    return open_backend(
        settings.backend,
        fingerprint=fingerprint,
        path=path,
        url=settings.url,
        max_bytes=settings.max_bytes,
        timeout_s=settings.timeout_s,
        log=log,
        require_server=require_server,
        seal=load_seal(settings.secret, settings.secret_file),
        password=password_of(settings.password),
    )


def open_backend(
    name: str,
    *,
    fingerprint: bytes,
    path: str = "",
    url: str = "",
    max_bytes: int = 1 << 30,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    log: StorageLog | None = None,
    require_server: bool = True,
    seal: Seal | None = None,
    password: str = "",
) -> StorageBackend:
    """Open the backend registered as ``name`` at an explicit place (tests, benchmarks; a
    run's actors open theirs with :func:`open_storage`).

    ``fingerprint`` is the 16-byte namespace of the blocks (``Fingerprint.digest()``):
    blobs written under another one read as misses. ``max_bytes`` bounds ``local``
    and ``memory`` (0: no bound); on ``redis`` the server's ``maxmemory`` does.
    ``timeout_s`` bounds each connect and each reply of ``redis``, so a server that
    stopped answering costs that long, not a hang.
    Raises :class:`ConfigError` naming the key for an unknown backend or a missing
    ``path``/``url``, and :class:`StorageUnavailable` if a server cannot be reached;
    with ``require_server=False`` an unreachable server is a ``storage.unreachable``
    warning instead, and each call raises ``StorageUnavailable`` until it is reachable
    (the actors open it so: a tier that is down at launch costs misses, not the run).
    With ``seal`` (a storage secret's, :mod:`.seal`), every blob is written with a tag and
    read only if its tag verifies. ``password`` is the redis server's (its URL holds
    none, :mod:`.url`).
    """
    entry = backend(name)
    if max_bytes < 0:
        raise ConfigError(
            f"cache.storage.max_bytes: must be >= 0, got {max_bytes}", key="cache.storage.max_bytes"
        )
    if not timeout_s > 0:
        raise ConfigError(
            f"cache.storage.timeout_s: must be > 0, got {timeout_s}", key="cache.storage.timeout_s"
        )
    check_key(fingerprint, "fingerprint")
    place = Place(
        path=path,
        url=url,
        max_bytes=max_bytes,
        timeout_s=timeout_s,
        require_server=require_server,
        seal=seal,
        password=password,
    )
    return entry.open(fingerprint, place, log)

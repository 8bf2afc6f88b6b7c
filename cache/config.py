"""The ``[cache]`` and ``[cache.storage]`` sections: block size, the pools, demotion, storage.

Read by the scheduler's block bookkeeping (through ``TierConfig``), by the Worker and the
Transfer lanes (the KV layouts), and by the storage clients. ``runtime.config`` loads and
checks them from each field's metadata (:func:`setting`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ringfence.cache.storage.registry import BACKEND_NAMES
from ringfence.cache.storage.seal import SECRET_ENV
from ringfence.cache.storage.url import PASSWORD_ENV, split_password

# ruff: noqa: RUF009 (setting() returns a dataclasses.field(), which ruff cannot see)

T = TypeVar("T")
Eviction = Literal["write_back", "write_through", "none"]
# The storage registry's names (cache/storage/registry.py): a backend registered there is
# a choice here. mypy sees a str, since a Literal cannot be built from data; the config
# loader checks values against the Literal.
if TYPE_CHECKING:
    Backend = str
else:
    Backend = Literal[BACKEND_NAMES]


def setting(default: T, doc: str, **rules: Any) -> T:
    """A config field: its default, one-line doc and rules, as ``runtime.config.setting``
    keeps them (the cache and the scheduler may not import the runtime, so theirs is this)."""
    return dataclasses.field(default=default, metadata={"doc": doc, **rules})


# The metadata key of a secret setting: runtime.config_tables.SECRET (tests check they agree).
SECRET = "secret"


def secret_setting(doc: str, env: str) -> str:
    """A string setting that is a secret carried to the actors by environment variable
    ``env``, as ``runtime.secrets.secret`` declares one (runtime/secrets.py)."""
    return dataclasses.field(default="", repr=False, metadata={"doc": doc, SECRET: env})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StorageConfig:
    """[cache.storage]: the storage tier below host memory."""

    backend: Backend = setting("local", "storage backend; 'none' disables the storage tier")
    path: str = setting("", "directory of the 'local' backend; empty = <run dir>/storage")
    url: str = setting(
        "", "server URL of the 'redis' backend: redis:// or rediss:// (TLS), [user@]host:port/db"
    )
    password: str = secret_setting(
        "the 'redis' server's password (of the URL's user); a password written in the URL is "
        f"moved here; a secret: never written to the run dir, handed to the actors as "
        f"{PASSWORD_ENV}",
        env=PASSWORD_ENV,
    )
    secret: str = secret_setting(
        "the tier's secret: every block carries a keyed MAC and one that does not verify is a "
        f"miss; instances sharing a tier share it; a secret: never written to the run dir, "
        f"handed to the actors as {SECRET_ENV} (no comma in it)",
        env=SECRET_ENV,
    )
    secret_file: str = setting(
        "", "a file holding the storage secret (its first line not blank nor '#'); empty = none"
    )
    max_bytes: int = setting(1 << 30, "capacity of the storage tier in bytes", ge=0)
    timeout_s: float = setting(
        2.0, "'redis': the most seconds a connect or a reply may take", gt=0, le=3600
    )
    presence_timeout_s: float = setting(
        0.05,
        "the most seconds the engine waits to learn what the tier holds; later is a miss",
        gt=0,
        le=60,
    )

    def __post_init__(self) -> None:
        # A password in the URL is the password setting's: the URL is written to the run
        # dir and printed, the secret is not (cache/storage/url.py).
        url, password = split_password(self.url)
        if not password:
            return
        if self.password and self.password != password:
            raise ValueError(
                "cache.storage.url: holds a password, and cache.storage.password another one"
            )
        object.__setattr__(self, "url", url)
        object.__setattr__(self, "password", password)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    """[cache]: KV block size, the pool of each tier and how blocks move down."""

    block_size: int = setting(16, "tokens per KV block", ge=1, le=4096)
    # The defaults are sized for a first run of the tiny preset: the main job's chat
    # (synthetic:chat) outgrows both pools, so its returning turns reach host and storage.
    device_blocks: int = setting(
        256,
        "KV blocks in the device pool; on CUDA, unless set, as many as "
        "cache.gpu_memory_utilization leaves beside the weights and activations",
        ge=1,
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "on CUDA: the fraction of the device's total memory this instance may use for its "
        "weights, activations and KV cache (vLLM's gpu_memory_utilization)",
        gt=0,
        le=1,
    )
    host_blocks: int = setting(768, "KV blocks in the host pool; 0 = no host cache tier", ge=0)
    device_eviction: Eviction = setting(
        "write_back", "device tier: write_back (demote on eviction), write_through or none"
    )
    host_eviction: Eviction = setting("write_back", "host tier, demoting to storage: the same")
    poison_freed: bool = setting(False, "fill freed and swapped-out device blocks with NaN (debug)")
    storage: StorageConfig = dataclasses.field(default_factory=StorageConfig)

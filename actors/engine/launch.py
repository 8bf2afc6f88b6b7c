"""The engine's launch: the default topology of a run (``runtime.topology``, as
``ringfence.actors.engine:TOPOLOGY``) and the checks the runtime runs before a run exists
(the topology's ``preflight``, by import path), each a ValueError naming the keys at fault.

The topology is the Engine, the Worker, both Transfer lanes and the client slots. The
storage backend's checks read its registry entry
(:data:`ringfence.cache.storage.registry.BACKENDS`), never its name.
"""

from __future__ import annotations

from typing import Protocol

from ringfence.actors.client.client import CLIENT_ACTOR, CLIENT_CHANNELS
from ringfence.actors.engine.config import EngineConfig
from ringfence.actors.model.config import ModelConfig
from ringfence.actors.model.identity import model_shape
from ringfence.actors.topology import FencedTopology
from ringfence.cache.config import CacheConfig
from ringfence.cache.storage.registry import BACKENDS, backend
from ringfence.cache.storage.seal import load_seal
from ringfence.runtime.extras import require
from ringfence.sched.config import SchedConfig, max_model_len

# Clients stop first (not waited for), then the engine, then the executors.
# The engine reads engine.workload and sched.max_model_len: a line it could not read, or a
# limit past the model's positions, is refused before the run.
TOPOLOGY = FencedTopology(
    engine="ringfence.actors.engine.actor:Engine",
    before=(CLIENT_ACTOR,),
    channels=CLIENT_CHANNELS,
    preflight=(
        "ringfence.actors.engine.intake:check_workload",
        "ringfence.actors.engine.launch:check_limits",
        "ringfence.actors.engine.launch:check_role",
        "ringfence.actors.engine.launch:check_storage",
    ),
)


class LaunchSections(Protocol):
    """The sections the launch checks read; the run's whole config, as the runtime gives it
    to a preflight check."""

    @property
    def model(self) -> ModelConfig: ...
    @property
    def cache(self) -> CacheConfig: ...
    @property
    def sched(self) -> SchedConfig: ...
    @property
    def engine(self) -> EngineConfig: ...


def check_limits(config: LaunchSections) -> None:
    """The launch's check of ``sched.max_model_len`` against the model the config names,
    before a run exists (ValueError naming the key; the runtime knows it only by name)."""
    max_model_len(config.sched, model_shape(config.model).max_position)


def check_storage(config: LaunchSections) -> None:
    """The launch's check that the storage backend's client library is installed (the
    engine and the store lanes import it in their own processes, where a missing one would
    be an actor's failure): MissingExtra naming the extra that installs it; and that the
    storage secret can be read, and is one (ConfigError naming the setting or file)."""
    name = config.cache.storage.backend
    if library := backend(name).requires:
        require(library, f"cache.storage.backend = {name!r}")
    if name != "none":
        load_seal(config.cache.storage.secret, config.cache.storage.secret_file)


def check_role(config: LaunchSections) -> None:
    """The launch's check of ``engine.role`` against the rest of the config (ValueError
    naming the keys): a prefill or decode instance shares KV through a storage tier that
    another instance can reach, and a decode instance preempts by ``save``."""
    role, storage = config.engine.role, config.cache.storage
    if role == "both":
        return
    entry = backend(storage.backend)
    if not entry.shared:
        shared = ", or ".join(f"{n!r} with {b.how_shared}" for n, b in BACKENDS.items() if b.shared)
        raise ValueError(
            f"engine.role = {role!r} hands KV over through a shared storage tier, but "
            f"cache.storage.backend is {storage.backend!r}: use {shared}"
        )
    if entry.path_in_run_dir and not storage.path:
        raise ValueError(
            f"engine.role = {role!r} hands KV over through a shared storage tier, but "
            "cache.storage.path is empty (the run's own directory, which no other instance "
            f"reads): set it to {entry.how_shared}"
        )
    if role == "decode" and config.sched.preemption != "save":
        raise ValueError(
            "engine.role = 'decode' preempts by writing to the shared tier: set "
            f"sched.preemption = 'save' (it is {config.sched.preemption!r})"
        )
    if role == "decode" and config.engine.workload:
        raise ValueError(
            "engine.role = 'decode' takes requests only by reservation (through "
            "'ringfence router'); engine.workload would run none of them"
        )

"""The ``[engine]`` section: the workload the engine runs, its clients' limit, its shutdown;
and :class:`EngineSettings`, every section the Engine actor reads."""

from __future__ import annotations

import dataclasses
from typing import Literal

from ringfence.actors.events.config import EventsConfig
from ringfence.actors.executors.config import TransferConfig
from ringfence.actors.model.config import ModelConfig, ParallelConfig
from ringfence.cache.config import CacheConfig
from ringfence.runtime.config import setting
from ringfence.sched.config import SchedConfig

# ruff: noqa: RUF009 (setting() returns a dataclasses.field(), which ruff cannot see)

Role = Literal["both", "prefill", "decode"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """[engine]: the workload the engine runs (``launch --workload``), and its shutdown."""

    workload: str = setting(
        "", "a JSON-lines file or synthetic:NAME to run to completion; empty = serve clients"
    )
    requests: int = setting(0, "requests of the workload to run; 0 = all of it", ge=0)
    seed: int = setting(0, "seed of a synthetic workload", ge=0)
    arrivals: bool = setting(True, "honour each request's arrival_s; false = all at once")
    progress: bool = setting(True, "show progress on the terminal during a workload")
    drain_timeout_s: float = setting(
        30.0, "at shutdown, how long to wait for the store lane's writes in flight", ge=0
    )
    role: Role = setting(
        "both",
        "both, or one side of prefill/decode disaggregation "
        '(docs/design.md, "Instances (prefill/decode disaggregation)"): '
        "prefill writes every finished request's blocks to the shared storage tier and "
        "answers once they are durable; decode takes requests only by reservation",
    )
    reservation_ttl_s: float = setting(
        10.0, "a decode instance's reservation unclaimed this long expires", gt=0, le=3600
    )
    max_requests_per_client: int = setting(
        256, "requests one client may have live; more are refused (backpressure)", ge=1
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineSettings:
    """What the Engine actor receives of the run's config (its ``config_section``): each
    field the section of the same name, filled by the runtime when the engine starts."""

    model: ModelConfig  # its tokenizer and chat template; the block fingerprint
    cache: CacheConfig  # the pools the scheduler keeps; the storage tier it asks
    sched: SchedConfig  # the scheduler's limits and preemption policy
    transfer: TransferConfig  # mode sync holds an op until its fence is met
    engine: EngineConfig  # the workload, the clients' limit, the role, the drain
    parallel: ParallelConfig  # how many ranks each op goes to
    events: EventsConfig  # whether and where it publishes KV events

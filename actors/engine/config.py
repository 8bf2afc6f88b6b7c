"""The ``[engine]`` section: the workload the engine runs, its clients' limit, its shutdown."""

from __future__ import annotations

import dataclasses
from typing import Literal

from ringfence.runtime.config import setting

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
        'both, or one side of prefill/decode disaggregation (DESIGN.md "Instances"): '
        "prefill writes every finished request's blocks to the shared storage tier and "
        "answers once they are durable; decode takes requests only by reservation",
    )
    reservation_ttl_s: float = setting(
        10.0, "a decode instance's reservation unclaimed this long expires", gt=0, le=3600
    )
    max_requests_per_client: int = setting(
        256, "requests one client may have live; more are refused (backpressure)", ge=1
    )

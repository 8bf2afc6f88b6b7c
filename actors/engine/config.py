"""The ``[engine]`` section: the workload the engine runs, its clients' limit, its shutdown."""

from __future__ import annotations

import dataclasses

from ringfence.runtime.config import setting


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
    max_requests_per_client: int = setting(
        256, "requests one client may have live; more are refused (backpressure)", ge=1
    )

"""The ``[transfer]`` section: how block copies are ordered against model steps, and the
debug knobs every lane executor reads; and :class:`LaneSettings`, every section a lane
executor (the Worker, the swap and store lanes) reads."""

from __future__ import annotations

import dataclasses
from typing import Literal

from ringfence.actors.model.config import ModelConfig, ParallelConfig
from ringfence.cache.config import CacheConfig
from ringfence.runtime.config import setting

# ruff: noqa: RUF009 (setting() returns a dataclasses.field(), which ruff cannot see)

TransferMode = Literal["fence", "sync", "lock"]
BlockCopy = Literal["auto", "runs", "kernel"]  # resolved by actors/kv/copies.py


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TransferConfig:
    """[transfer]: how block copies are ordered against model steps."""

    mode: TransferMode = setting(
        "fence",
        "fence (asynchronous, ordered by fences), or the baselines sync (an op held until "
        "what it waits for is complete) and lock (fences plus the legacy design's lock "
        "around every step and every copy)",
        debug=("sync", "lock"),
    )
    copy: BlockCopy = setting(
        "auto",
        "how the swap lane copies a swap's blocks: 'runs', one copy per run of consecutive "
        "blocks; 'kernel', one Triton kernel launch for all of them (on CUDA it reads and "
        "writes the host tier in place, mapped into the device's address space); 'auto' is "
        "kernel on a CUDA device when Triton is installed, else runs",
    )
    lock_timeout_s: float = setting(
        30.0, "mode lock: seconds an executor waits for the lock before its op fails", gt=0
    )
    chaos_delay_ms: float = setting(
        0.0, "random delay per transfer op, in ms (debug)", ge=0, debug=()
    )
    skip_fences: bool = setting(
        False, "debug only: executors do not wait for fences (tests show they catch it)", debug=()
    )
    profile: bool = setting(
        False,
        "debug: each executor's process records torch's profiler over its ops (on a GPU its "
        "kernels and copies too) into <run dir>/profile-<actor>-<rank>.<incarnation>.json, "
        "which ringfence replay --trace puts on the run's timeline",
        debug=(),
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LaneSettings:
    """What each lane executor receives of the run's config (its ``config_section``): each
    field the section of the same name, filled by the runtime when the lane starts."""

    model: ModelConfig  # the Worker's weights and device; every lane's KV layout
    cache: CacheConfig  # the pools, their poisoning, the storage the store lane writes
    transfer: TransferConfig  # the mode (lock: the legacy lock), the copy, chaos, skip_fences
    parallel: ParallelConfig  # the ranks: each lane's share of the KV heads

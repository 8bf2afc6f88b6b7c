"""The ``[sched]`` section, and everything a :class:`~ringfence.sched.scheduler.Scheduler`
is built with: that section, the tiers' pools and policies, and the model's limits.

``SchedConfig`` is the TOML table (``runtime.config`` loads and checks it from each
field's metadata); ``TierConfig`` and ``SchedulerConfig`` are what the engine derives
from the run's config and the model it serves (``actors/engine/begin.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from ringfence.cache.config import Eviction, setting

# ruff: noqa: RUF009 (setting() returns a dataclasses.field(), which ruff cannot see)

Preemption = Literal["recompute", "swap", "save"]
POLICIES = get_args(Preemption)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SchedConfig:
    """[sched]: batch limits and what preemption does with a sequence's blocks."""

    # On CUDA, unless set, a GPU server's limits instead (actors/device_defaults.py).
    max_num_seqs: int = setting(16, "most sequences in one batch (on CUDA, unless set: 256)", ge=1)
    max_batched_tokens: int = setting(
        512, "most tokens in one step (on CUDA, unless set: 8192)", ge=1
    )
    preemption: Preemption = setting("recompute", "recompute, swap (to host) or save (to storage)")
    reserve_blocks: int = setting(
        -1,
        "a decode instance (engine.role) grants a reservation only if its blocks fit beside "
        "this many kept for running requests' growth; -1 = all they may still grow into "
        "(their max_tokens), so no new request ever makes a running one preempted",
        ge=-1,
    )
    max_model_len: int = setting(
        0,
        "longest prompt plus max_tokens a request may ask for; 0 = the model's"
        " max_position_embeddings",
        ge=0,
    )
    # 2 is what a GPU wants: the Engine plans step N+1 while step N runs, and a sequence's
    # next input may be "the token step N sampled" (Piece.pending_from). A prefill instance
    # and tensor parallelism run one at a time (SchedulerConfig.steps_in_flight says why).
    steps_in_flight: int = setting(
        1,
        "step plans in flight on the step lane: 1 (plan after each result) or 2 (plan step "
        "N+1 while step N runs; on CUDA, unless set, 2)",
        ge=1,
        le=2,
    )


def max_model_len(settings: SchedConfig, max_position: int) -> int:
    """The longest prompt plus max_tokens a request may ask for: ``sched.max_model_len``, or
    the model's ``max_position`` where it is 0. ValueError naming the key and both numbers
    where it asks for more positions than the model has."""
    wanted = settings.max_model_len
    if wanted > max_position:
        raise ValueError(
            f"sched.max_model_len is {wanted}, more than the model's {max_position} positions "
            "(max_position_embeddings); set it to at most that, or 0 for the model's own"
        )
    return wanted or max_position


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TierConfig:
    """The pools and policies of the three tiers, as the block bookkeeping uses them."""

    block_size: int
    device_blocks: int
    host_blocks: int  # the host tensor's blocks: the cache tier, or only staging blocks
    host_cache: bool  # False: the host blocks only stage storage traffic, nothing is kept
    storage: bool  # a storage tier exists
    device_eviction: Eviction = "write_back"  # ringfence.cache.demotion policies
    host_eviction: Eviction = "write_back"
    poison_freed: bool = False


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """What a Scheduler is built with. Raises ValueError naming the keys for a preemption
    policy whose tier is missing."""

    sched: SchedConfig = dataclasses.field(default_factory=SchedConfig)
    tiers: TierConfig
    namespace: bytes  # the block keys' namespace: the digest of the block fingerprint
    max_model_len: int = 1 << 30  # longest prompt plus max_tokens (sched.max_model_len)
    vocab_size: int = 1 << 31  # token ids the model has (0 .. vocab_size - 1)
    # A prefill instance (engine.role): a finishing request's full blocks are written to
    # storage and the request held until they are (sched/handovers.py).
    handover: bool = False
    # Steps planned ahead of their inputs: sched.steps_in_flight, or 1 where that cannot
    # hold (actors/engine/begin.py): a prefill instance writes a finishing
    # request's blocks at its last token, which must not have a decode after it; under
    # tensor parallelism only rank 0 samples, so the other ranks lack the token a step
    # planned ahead takes as its input.
    steps_in_flight: int = 1

    def __post_init__(self) -> None:
        preemption = self.sched.preemption
        if preemption not in POLICIES:
            raise ValueError(f"sched.preemption must be one of {POLICIES}, got {preemption!r}")
        if preemption == "swap" and not self.tiers.host_cache:
            raise ValueError("sched.preemption = 'swap' needs a host tier (cache.host_blocks > 0)")
        if preemption == "save" and not self.tiers.storage:
            raise ValueError("sched.preemption = 'save' needs a storage tier (cache.storage)")
        if self.steps_in_flight not in (1, 2):
            raise ValueError(f"sched.steps_in_flight must be 1 or 2, got {self.steps_in_flight}")
        if self.handover and not self.tiers.storage:
            raise ValueError("a prefill instance needs a storage tier (cache.storage)")

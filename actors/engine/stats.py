"""The engine's :class:`Stats` for the clients that ask for them (``Hello.stats``).

Read from the scheduler (requests, preemptions, steps, pools, cache hits), the ledger
(ops complete and in flight per lane) and the engine's count of bytes moved; the
ClientHub holds and sends them; and the figures of a workload run's ``summary.json``.
Reads only; engine thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ringfence.actors.engine.ledger import Ledger
from ringfence.actors.protocol.client import Stats
from ringfence.cache.fences import Lane
from ringfence.sched.config import POLICIES
from ringfence.sched.scheduler import Scheduler

LANES = tuple(str(lane) for lane in Lane)  # "step", "swap", "store"
BYTES = ("swap_out", "swap_in", "store_write", "store_read")  # "<lane>_<direction>"
POOLS = ("device", "host")
HIT_TIERS = ("device", "host", "storage")


def no_stats() -> Stats:
    """What the engine reports before its scheduler began: every figure zero."""
    zeros = dict.fromkeys
    return Stats(
        incarnation=0,
        began=False,
        running=0,
        waiting=0,
        steps=0,
        preemptions=zeros(POLICIES, 0),
        ops=zeros(LANES, 0),
        bytes=zeros(BYTES, 0),
        in_flight=zeros(LANES, 0),
        blocks_used=zeros(POOLS, 0),
        blocks_total=zeros(POOLS, 0),
        hit_tokens=zeros(HIT_TIERS, 0),
    )


def stats_of(
    scheduler: Scheduler,
    ledger: Ledger,
    moved: Mapping[str, int],
    events: Mapping[str, str] | None = None,
) -> Stats:
    """The figures now; ``moved``: bytes copied per "<lane>_<direction>" (Engine.bytes);
    ``events``: the KV event endpoints bound (KVEventsOut.endpoints).

    ``incarnation`` is 0: the hub stamps each client's copy with its own.
    """
    c = scheduler.counters
    pools = {"device": scheduler.blocks.device, "host": scheduler.blocks.host}
    return Stats(
        incarnation=0,
        began=True,
        running=scheduler.num_running,
        waiting=scheduler.num_waiting,
        steps=c.steps,
        preemptions={policy: c.preemptions[policy] for policy in POLICIES},
        ops={str(lane): ledger.num_completed(lane) for lane in Lane},
        bytes={name: moved.get(name, 0) for name in BYTES},
        in_flight={str(lane): ledger.in_flight(lane) for lane in Lane},
        blocks_used={tier: pool.num_used for tier, pool in pools.items()},
        blocks_total={tier: pool.num_blocks for tier, pool in pools.items()},
        hit_tokens={tier: c.hit_tokens[tier] for tier in HIT_TIERS},
        free_blocks=scheduler.blocks.device.num_free,
        reservations=len(scheduler.reservations.live),
        reserved_blocks=scheduler.reservations.num_blocks,
        events_endpoint=(events or {}).get("endpoint", ""),
        events_replay_endpoint=(events or {}).get("replay_endpoint", ""),
    )


def count_bytes(
    moved: dict[str, int], scheduler: Scheduler, lane: Lane, number: int, nbytes: int
) -> None:
    """Add a transfer op's bytes (every rank's) to ``moved`` under "<lane>_<direction>";
    before the scheduler applies the op (it is still in flight there)."""
    op = scheduler.blocks.issuer.inflight.get((lane, number))
    if op is not None:
        name = f"{lane}_{op.direction}"
        moved[name] = moved.get(name, 0) + nbytes


def counters_of(scheduler: Scheduler, mode: str, moved: Mapping[str, int]) -> dict[str, Any]:
    """The engine's figures of a workload run, for ``summary.json`` (``mode``: the run's
    ``transfer.mode``; the preemption policy is the scheduler's ``sched.preemption``)."""
    c = scheduler.counters
    blocks = scheduler.blocks.issuer.moved
    return {
        "mode": mode,
        "preemption_policy": scheduler.config.sched.preemption,
        "preemptions": dict(c.preemptions),
        "hit_tokens": dict(c.hit_tokens),
        "steps": c.steps,
        "resets": c.resets,
        "retries": c.retries,
        "batched_tokens": c.batched_tokens,
        "ops": dict(blocks.ops),
        "blocks": dict(blocks.blocks),
        "bytes": dict(moved),
    }

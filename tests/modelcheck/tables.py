"""The model's fence rule against cache/fences.py: ops recorded from the real scheduler.

:func:`record` drives a :class:`ringfence.sched.scheduler.Scheduler` on small pools with
random requests that share prefixes (so that blocks are swapped, written back, prefetched
and reused), completing its ops in issue order with some failures and an occasional
Worker reset, and records every call of its :class:`FenceTracker`: the lane, the op's
number, the blocks it reads and writes on each tier, and the fence cache/fences.py gave.
:func:`table_pml` writes them as ``table.pml``; protocol.pml built with ``-DTABLE`` issues
them through the model's own fence rule and asserts (F) that each recorded fence covers
what its op's blocks need under that rule (a fence above it is counted, not failed: see
table_engine.pml). ``safety.py`` asks the same question of the rows in Python.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ringfence.cache.fences import Fence, FenceTracker, Lane, Tier
from ringfence.cache.ids import BlockHash, BlockId, Seq
from ringfence.cache.kv_events import KVEventJournal
from ringfence.sched.config import SchedConfig, SchedulerConfig, TierConfig
from ringfence.sched.ops import Op, StepOp, StoreOp
from ringfence.sched.request import Request, SamplingParams
from ringfence.sched.scheduler import Scheduler

Preemption = Literal["recompute", "swap", "save"]
LANE_NUMBER = {Lane.STEP: 0, Lane.SWAP: 1, Lane.STORE: 2}  # protocol.pml's STEP, SWAP, STORE
MAX_BLOCKS = 30  # a tier's blocks are bits of a Promela int mask


@dataclass(frozen=True, slots=True)
class Row:
    """One FenceTracker.issue call: an op as the fence rule sees it, and its fence."""

    lane: Lane
    seq: int
    read_device: frozenset[int]
    write_device: frozenset[int]
    read_host: frozenset[int]
    write_host: frozenset[int]
    fence: Fence


class RecordingTracker(FenceTracker):
    """A FenceTracker that keeps a Row of every op it issues."""

    __slots__ = ("resets", "rows")

    def __init__(self, num_device_blocks: int, num_host_blocks: int) -> None:
        super().__init__(num_device_blocks, num_host_blocks)
        self.rows: list[Row] = []
        # (rows issued before it, the tier): the tier resets the table and safety.py can
        # express. None is recorded: at a Worker restart the scheduler keeps every block's
        # record (the epochs cancel the older ops), so its fences stay on the safe side.
        self.resets: list[tuple[int, Tier]] = []

    def issue(
        self,
        lane: Lane,
        seq: Seq,
        *,
        read_device: Collection[BlockId] = (),
        write_device: Collection[BlockId] = (),
        read_host: Collection[BlockId] = (),
        write_host: Collection[BlockId] = (),
    ) -> Fence:
        fence = super().issue(
            lane, seq, read_device=read_device, write_device=write_device,
            read_host=read_host, write_host=write_host,
        )  # fmt: skip
        self.rows.append(Row(
            lane, int(seq), frozenset(read_device), frozenset(write_device),
            frozenset(read_host), frozenset(write_host), fence,
        ))  # fmt: skip
        return fence


class Presence:
    """Storage presence over the keys the scheduler's write-backs stored."""

    def __init__(self) -> None:
        self.keys: set[BlockHash] = set()

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        count = 0
        for key in keys:
            if key not in self.keys:
                break
            count += 1
        return count


def _scheduler(
    rng: random.Random,
    device_blocks: int,
    host_blocks: int,
    presence: Presence,
    preemption: Preemption | None = None,
    kv_events: KVEventJournal | None = None,
) -> Scheduler:
    tiers = TierConfig(
        block_size=4,
        device_blocks=device_blocks,
        host_blocks=host_blocks,
        host_cache=True,
        storage=True,
        device_eviction=rng.choice(["write_back", "write_through"]),
        host_eviction=rng.choice(["write_back", "write_through"]),
        poison_freed=rng.random() < 0.5,
    )
    drawn: Preemption = rng.choice(["swap", "save"])  # drawn always: the same draws after
    config = SchedulerConfig(
        sched=SchedConfig(max_num_seqs=4, max_batched_tokens=24, preemption=preemption or drawn),
        tiers=tiers,
        namespace=b"\0" * 16,
    )
    return Scheduler(config, presence, kv_events=kv_events)


def record(seed: int, **options: Any) -> list[Row]:
    """Every op a scheduler issued for random requests (seeded), in issue order: the rows
    of :func:`recording`'s tracker (``options`` as it takes them)."""
    return recording(seed, **options).rows


def recording(seed: int, **options: Any) -> RecordingTracker:
    """The tracker of :func:`record`'s run, its rows and resets (``options`` as
    :func:`driven` takes them: ``preemption``, the policy, else drawn; ``tracker_class``,
    the fence rule, a mutant's in safety.py)."""
    return driven(seed, **options)[1]


def driven(
    seed: int,
    *,
    requests: int = 6,
    device_blocks: int = 10,
    host_blocks: int = 10,
    preemption: Preemption | None = None,
    tracker_class: type[RecordingTracker] = RecordingTracker,
    kv_events: KVEventJournal | None = None,
) -> tuple[Scheduler, RecordingTracker]:
    """:func:`recording`'s run: the scheduler at its end and its tracker (``kv_events``:
    the scheduler's KV events journal)."""
    rng = random.Random(f"ringfence.modelcheck:{seed}")
    presence = Presence()
    sched = _scheduler(rng, device_blocks, host_blocks, presence, preemption, kv_events)
    tracker = tracker_class(device_blocks, host_blocks)
    sched.blocks.issuer.tracker = tracker
    shared = [rng.randrange(1, 50) for _ in range(8)]
    for index in range(requests):
        fresh = [rng.randrange(1, 50) for _ in range(rng.randrange(2, 14))]
        prompt = shared[: rng.randrange(0, 9)] + fresh
        sched.add(Request(
            request_id=f"r{index}", prompt_token_ids=tuple(prompt),
            params=SamplingParams(max_tokens=rng.randrange(2, 10)), arrival=float(index),
        ))  # fmt: skip
    for _ in range(400):
        ops = sched.schedule()
        if not ops and sched.idle:
            break
        _complete(sched, ops, rng, presence)
    return sched, tracker


def _complete(sched: Scheduler, ops: Iterable[Op], rng: random.Random, presence: Presence) -> None:
    """Complete every op in issue order (a transfer fails now and then; now and then the
    Worker restarts with a step in flight)."""
    step: StepOp | None = None
    for op in ops:
        if isinstance(op, StepOp):
            step = op
            continue
        status = "failed" if rng.random() < 0.05 else "ok"
        if isinstance(op, StoreOp) and op.direction == "write" and status == "ok":
            presence.keys.update(op.keys)
        sched.on_transfer(op.lane, op.number, status)
    if step is None:
        return
    if rng.random() < 0.02:
        sched.reset_device()
        return
    outputs = [(p.seq_id, rng.randrange(1, 50)) for p in step.pieces if p.sample]
    sched.on_step(step.step, "ok" if rng.random() > 0.03 else "failed", outputs)


def _mask(blocks: Iterable[int]) -> int:
    mask = 0
    for block in blocks:
        if not 0 <= block < MAX_BLOCKS:
            raise ValueError(f"block {block} is past the {MAX_BLOCKS} a table can hold")
        mask |= 1 << block
    return mask


RESET_BIT = {Tier.DEVICE: 1, Tier.HOST: 2}  # table_engine.pml's t_rst


def table_pml(rows: Sequence[Row], resets: Sequence[tuple[int, Tier]] = ()) -> str:
    """``table.pml``: TN and an inline ``fill_table()`` assigning every row, and before
    which row each tier was reset (a :class:`RecordingTracker`'s ``resets``)."""
    lines = [
        "/* Generated by tests/modelcheck/tables.py from the real scheduler: do not edit. */",
        f"#define TN {len(rows)}",
        "inline fill_table() {",
    ]
    reset_before = [0] * (len(rows) + 1)
    for before, tier in resets:
        reset_before[before] |= RESET_BIT[tier]
    for k, row in enumerate(rows):
        f = row.fence
        if reset_before[k]:
            lines.append(f"  t_rst[{k}] = {reset_before[k]};")
        lines.append(
            f"  t_lane[{k}] = {LANE_NUMBER[row.lane]}; t_seq[{k}] = {row.seq}; "
            f"t_rdD[{k}] = {_mask(row.read_device)}; t_wrD[{k}] = {_mask(row.write_device)}; "
            f"t_rdH[{k}] = {_mask(row.read_host)}; t_wrH[{k}] = {_mask(row.write_host)}; "
            f"t_f[{3 * k}] = {f.step}; t_f[{3 * k + 1}] = {f.swap}; t_f[{3 * k + 2}] = {f.store};"
        )
    lines.append("}")
    return "\n".join(lines) + "\n"

"""What the scheduler keeps per request, its decisions and its counters.

:class:`Sequence` is the scheduler's state of one request beyond the request itself
(its device block table, keys, held host blocks, prefetch in flight); owned and
mutated by the :class:`ringfence.sched.scheduler.Scheduler` (and the admission path it
delegates to, ``ringfence.sched.admission``) only. :class:`Journal` records the
scheduler's decisions (:class:`Decision`) for the engine's log.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import NamedTuple

from ringfence.cache.ids import BlockHash, BlockId
from ringfence.sched.request import Request


class Tail(NamedTuple):
    """The partial last block of a swap-preempted sequence, held on host."""

    host_block: BlockId
    position: int  # its place in the sequence's block table
    num_tokens: int  # computed tokens in it


@dataclass(slots=True, eq=False)
class Sequence:
    """The scheduler's state of one request beyond the request itself."""

    seq_id: int
    request: Request
    blocks: list[BlockId] = field(default_factory=list)  # device block table
    keys: list[BlockHash] = field(default_factory=list)  # keys of its full blocks, in order
    num_keyed: int = 0  # leading blocks already given their keys on device
    held: list[BlockId] = field(default_factory=list)  # host blocks it holds a reference on
    tail: Tail | None = None  # a swapped-out partial block (swap preemption)
    prefetch: tuple[int, tuple[BlockId, ...], tuple[int, ...]] | None = None  # op, host, where
    storage_until: int | None = None  # blocks from here are not taken from storage (failed)
    admitted: int = -1  # admission order; the newest is preempted first
    admissions: int = 0
    from_storage: set[BlockHash] = field(default_factory=set)  # prefetched keys, for counting
    failed_steps: int = 0  # its steps that failed since its last token (Scheduler.on_step)
    opened: bool = False  # a piece since its admission carried its Opening to the Worker
    # Two steps in flight (sched.steps_in_flight = 2): the step in flight that samples its
    # next token (0: none), and the step in flight whose decode takes that token as its
    # input before the scheduler learns it (0: none; Piece.pending_from).
    sampled_by: int = 0
    pending_in: int = 0

    def take_holds(self) -> list[BlockId]:
        """The host blocks it holds a reference on (its held copies, then its tail's block),
        for the caller to release; it holds none after (``held`` empty, no ``tail``)."""
        holds = self.held + ([self.tail.host_block] if self.tail is not None else [])
        self.held, self.tail = [], None
        return holds


class Decision(NamedTuple):
    """One scheduling decision about a sequence, for the engine's trace log and replay."""

    kind: str  # "admit", "resume" (admitted again), "prefetch", "preempt", "reset", "retry"
    seq_id: int
    detail: dict[str, int | str]  # admit/resume: computed, device, host, storage (tokens);
    # prefetch: op, blocks; preempt: policy (the one used), computed (tokens dropped);
    # reset (the device tier was lost under a running sequence): computed;
    # retry (a step of it failed; computed again): computed


class Journal:
    """The decisions since the last :meth:`take`, for the engine's log; when not
    ``enabled``, it records nothing (and the scheduler skips working out details)."""

    def __init__(self, enabled: bool) -> None:
        self._decisions: list[Decision] | None = [] if enabled else None

    @property
    def enabled(self) -> bool:
        return self._decisions is not None

    def record(self, kind: str, seq: Sequence, **detail: int | str) -> None:
        """Append the decision ``kind`` about ``seq`` (a no-op when not enabled)."""
        if self._decisions is not None:
            self._decisions.append(Decision(kind, seq.seq_id, detail))

    def take(self) -> list[Decision]:
        """The decisions recorded since the last call, in order; clears them."""
        if not self._decisions:
            return []
        taken, self._decisions = self._decisions, []
        return taken


@dataclass(frozen=True, slots=True)
class Emitted:
    """What applying a step result produced for one request."""

    request: Request
    token_ids: tuple[int, ...]  # new output tokens
    finished: bool
    seq_id: int  # the sequence, whose sampled tokens carry its logprobs


@dataclass(frozen=True, slots=True)
class HandOver:
    """A prefill instance's finished request whose full blocks are being written to storage
    for a decode instance (docs/design.md, "Instances (prefill/decode disaggregation)"): the
    engine holds its finish until the store op ``mark`` is complete on every rank, then
    reports how many leading blocks are durable
    (:meth:`ringfence.sched.handovers.HandOvers.stored_blocks`)."""

    request_id: str
    keys: tuple[BlockHash, ...]  # its full blocks' keys, in order
    mark: int  # the last store op issued with its writes: complete -> they are done
    present: frozenset[BlockHash]  # keys storage held already (not written again)


@dataclass(slots=True)
class Counters:
    preemptions: Counter[str] = field(default_factory=Counter)  # by policy used
    hit_tokens: Counter[str] = field(default_factory=Counter)  # by tier, every admission
    steps: int = 0
    batched_tokens: int = 0
    resets: int = 0  # device tiers lost (Worker restarts)
    retries: int = 0  # sequences computed again after a failed step

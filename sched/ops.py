"""The ops the scheduler issues, exactly as they travel and as the executors read them.

One type per op, from the scheduler to the wire to the executor: the scheduler makes
these (its epoch left 0), the engine stamps its epoch on each (``dataclasses.replace``)
and sends it, the protocol modules register these classes with their channels
(``ringfence.actors.protocol``), and the Worker and the Transfer lanes read them. So
every field is a value the wire codec carries: ints, tuples of ints, a ``Fence``, a
sequence's ``SamplingParams``, and content keys as ``bytes`` (written as hex on the wire).

The order of a scheduler's op list is the issue order: the fences were computed in it,
and the sequential execution of the list in that order is what every correct
execution of the protocol equals (docs/design.md, "Sequence numbers, watermarks, fences").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ringfence.cache.fences import Fence, Lane
from ringfence.cache.ids import BlockHash
from ringfence.sched.sampling import SamplingParams

# Why a transfer op was issued, for metrics and for reading a log.
# "handover": a prefill instance's finished request, for a decode instance to prefetch.
Reason = Literal["evict", "through", "preempt", "admit", "resume", "handover"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Opening:
    """What the Worker keeps of a sequence, sent with its first piece after each admission
    (and after a preemption or a reset, which send it back to waiting) instead of with
    every piece: how to sample it, and the tokens a penalty counts or a grammar's matcher
    replays that the Worker will not see in a piece (those before the piece's start: a
    prefix cache hit, or KV swapped back in). The Worker forgets it when the sequence is in
    a step's ``closed``."""

    params: SamplingParams
    num_prompt_tokens: int  # positions from here on are output (the penalties' tokens)
    history: tuple[int, ...] = ()  # positions 0 .. start - 1 when params.needs_history


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """One sequence's share of a step: a prefill chunk (any length >= 1), or the one token
    of a decode.

    A decode planned while the step before it runs (``sched.steps_in_flight = 2``) may
    take as its input the token that step samples for the sequence, which the scheduler
    does not know yet: ``pending_from`` names that step, and ``token_ids`` holds a
    placeholder that the Worker replaces with the token it sampled there before it reads
    the piece (a Worker that lacks it rejects the step)."""

    seq_id: int  # the scheduler's id of the sequence, echoed with its sampled token
    token_ids: tuple[int, ...]  # tokens at positions start .. start + len - 1
    start: int  # positions 0 .. start - 1 already have KV in the sequence's blocks
    block_table: tuple[int, ...]  # device blocks covering positions 0 .. start + len - 1
    sample: bool  # the piece ends the known tokens: sample the next one
    opening: Opening | None = None  # the sequence's first piece since it was admitted
    pending_from: int = 0  # > 0: its one token is the one step pending_from sampled for it

    @property
    def end(self) -> int:
        """The position after the piece's last token."""
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOp:
    """Step ``step`` of the step lane (a "step plan"): fill ``poison`` with NaN, then run
    ``pieces`` as one batch."""

    step: int  # 1, 2, ...: the Worker runs step s only after s - 1
    epoch: int = 0  # the issuer's epoch (the engine stamps it), echoed in the result
    fence: Fence  # the swap_done/store_done values to wait for (its step field is 0)
    pieces: tuple[Piece, ...]
    poison: tuple[int, ...] = ()  # freed device blocks to fill with NaN (cache.poison_freed)
    closed: tuple[int, ...] = ()  # sequences ended since the last step: the Worker forgets them

    lane = Lane.STEP

    @property
    def number(self) -> int:
        return self.step


@dataclass(frozen=True, slots=True, kw_only=True)
class SwapOp:
    """Swap op ``op``: copy ``device_blocks[i]`` to (out) or from (in) ``host_blocks[i]``."""

    op: int  # 1, 2, ...: the swap lane's sequence number
    epoch: int = 0  # the issuer's epoch (the engine stamps it)
    fence: Fence  # step_done and store_done values to wait for (its swap field is 0)
    direction: Literal["in", "out"]  # in: host -> device; out: device -> host
    device_blocks: tuple[int, ...]
    host_blocks: tuple[int, ...]
    reason: Reason

    lane = Lane.SWAP

    @property
    def number(self) -> int:
        return self.op


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreOp:
    """Store op ``op``: write host blocks to storage under ``keys`` (write-back), or read
    them back (prefetch)."""

    op: int  # 1, 2, ...: the store lane's sequence number
    epoch: int = 0  # the issuer's epoch (the engine stamps it)
    fence: Fence  # swap_done values to wait for (its store field is 0)
    direction: Literal["write", "read"]
    host_blocks: tuple[int, ...]
    keys: tuple[BlockHash, ...]  # each block's content key (16 bytes)
    reason: Reason

    lane = Lane.STORE

    @property
    def number(self) -> int:
        return self.op


Op = StepOp | SwapOp | StoreOp

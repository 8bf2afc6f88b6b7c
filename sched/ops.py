"""The ops the scheduler issues: numbered, fenced, in issue order; block ids only.

The engine turns each into a protocol message (adding its epoch) and sends it to the
lane's executor. The order of a scheduler's op list is the issue order: the fences
were computed in it, and the sequential execution of the list in that order is what
every correct execution of the protocol equals (DESIGN.md, "Sequence numbers,
watermarks, fences").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ringfence.cache.fences import Fence, Lane
from ringfence.cache.ids import BlockHash

# Why a transfer op was issued, for metrics and for reading a log.
Reason = Literal["evict", "through", "preempt", "admit", "resume"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """One sequence's share of a step: a prefill chunk, or the one token of a decode."""

    seq_id: int  # the scheduler's id of the sequence
    token_ids: tuple[int, ...]  # tokens at positions start .. start + len - 1
    start: int  # positions 0 .. start - 1 already have KV in the sequence's blocks
    block_table: tuple[int, ...]  # device blocks covering positions 0 .. start + len - 1
    sample: bool  # the piece ends the known tokens: sample the next one
    temperature: float
    seed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StepOp:
    """Step ``step``: fill ``poison`` with NaN (debug), then run ``pieces``."""

    step: int
    fence: Fence
    pieces: tuple[Piece, ...]
    poison: tuple[int, ...] = ()

    lane = Lane.STEP

    @property
    def number(self) -> int:
        return self.step


@dataclass(frozen=True, slots=True, kw_only=True)
class SwapOp:
    """Swap op ``op``: copy ``device_blocks[i]`` to (out) or from (in) ``host_blocks[i]``."""

    op: int
    fence: Fence
    direction: Literal["in", "out"]
    device_blocks: tuple[int, ...]
    host_blocks: tuple[int, ...]
    reason: Reason

    lane = Lane.SWAP

    @property
    def number(self) -> int:
        return self.op


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreOp:
    """Store op ``op``: write host blocks to storage under ``keys`` or read them back."""

    op: int
    fence: Fence
    direction: Literal["write", "read"]
    host_blocks: tuple[int, ...]
    keys: tuple[BlockHash, ...]
    reason: Reason

    lane = Lane.STORE

    @property
    def number(self) -> int:
        return self.op


Op = StepOp | SwapOp | StoreOp

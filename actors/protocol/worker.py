"""The channels between the Engine and the Workers: one registry per direction.

``TO_WORKER`` (engine -> worker) carries step plans, the scheduler's own
:class:`~ringfence.sched.ops.StepOp` (one type from scheduler to wire to Worker);
``FROM_WORKER`` (worker -> engine) carries the worker's announcement and step results.
Every message names its step number ``s`` (the step lane's sequence number, docs/design.md,
"Sequence numbers, watermarks, fences") and the issuer's epoch, and a plan carries its
fence: the worker touches no block before every watermark named in the fence has
reached it. KV data never travels here, only block ids.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from ringfence.actors.kv.space import KVHandle
from ringfence.actors.model.info import ModelInfo
from ringfence.actors.protocol.resync import Resync
from ringfence.runtime.codec import Registry, message
from ringfence.sched.ops import StepOp
from ringfence.sched.sampling import TokenLogprobs

TO_WORKER = Registry("engine-to-worker")
FROM_WORKER = Registry("worker-to-engine")

StepStatus = Literal["ok", "rejected", "cancelled", "failed"]


@message(FROM_WORKER, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerReady:
    """Sent on every start: a (re)started worker has a fresh device tier."""

    rank: int
    epoch: int  # the run epoch the worker started in
    incarnation: int  # 1 for the first start, +1 per restart
    step_done: int  # the step watermark it resumes from
    model: ModelInfo
    kv: KVHandle  # how the Transfer actor opens the device KV tensor
    resync: int = -1  # the epoch of the engine's Resync this answers; -1: sent on start


@dataclass(frozen=True, slots=True, kw_only=True)
class SampledToken:
    seq_id: int
    position: int  # position of the sampled token in its sequence
    token_id: int
    logprob: float  # under the raw logits (temperature 1), or model.logprobs_mode's
    rank: int = 1  # 1 + how many tokens were more probable (set when logprobs were asked)
    top: tuple[tuple[int, float], ...] = ()  # the logprobs asked for: (id, logprob), best first


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampled:
    """A step's sampled tokens as columns: row i is the i-th piece with sample=True, in piece
    order (what a :class:`SampledToken` holds, one list a field). A step of 256 sequences
    crosses as six lists, not 256 objects: building, encoding and decoding a token's object
    cost the Worker and the engine about 3 us each a token."""

    seq_ids: tuple[int, ...] = ()
    positions: tuple[int, ...] = ()  # of the sampled tokens in their sequences
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    ranks: tuple[int, ...] = ()
    tops: tuple[tuple[tuple[int, float], ...], ...] = ()  # per row; () where none was asked

    @classmethod
    def of(cls, tokens: Iterable[SampledToken]) -> Sampled:
        """The columns of ``tokens``, in their order."""
        rows = tuple(tokens)
        return cls(
            seq_ids=tuple(t.seq_id for t in rows),
            positions=tuple(t.position for t in rows),
            token_ids=tuple(t.token_id for t in rows),
            logprobs=tuple(t.logprob for t in rows),
            ranks=tuple(t.rank for t in rows),
            tops=tuple(t.top for t in rows),
        )

    def problem(self) -> str:
        """Why these columns are not one row each, or ""."""
        lengths = {
            name: len(getattr(self, name))
            for name in ("seq_ids", "positions", "token_ids", "logprobs", "ranks", "tops")
        }
        if len(set(lengths.values())) > 1:
            return f"sampled columns of unequal lengths: {lengths}"
        return ""

    def __len__(self) -> int:
        return len(self.seq_ids)

    def pairs(self) -> list[tuple[int, int]]:
        """(seq_id, token_id) of every row."""
        return list(zip(self.seq_ids, self.token_ids, strict=True))

    def token(self, row: int) -> SampledToken:
        """Row ``row`` as one object."""
        return SampledToken(
            seq_id=self.seq_ids[row],
            position=self.positions[row],
            token_id=self.token_ids[row],
            logprob=self.logprobs[row],
            rank=self.ranks[row],
            top=self.tops[row],
        )

    def tokens(self) -> tuple[SampledToken, ...]:
        """Every row as an object (for tools and tests; the hot paths read the columns)."""
        return tuple(self.token(row) for row in range(len(self)))


@dataclass(frozen=True, slots=True, kw_only=True)
class PromptLogprobs:
    """Log probabilities of a sequence's prompt tokens at positions start, start + 1, ...
    (each under the logits of the position before it), for a request that asked."""

    seq_id: int
    start: int  # the position of entries[0] (>= 1: the first prompt token has none)
    entries: tuple[TokenLogprobs, ...]


@message(FROM_WORKER, tag=2, version=2)  # 2: the sampled tokens as columns (Sampled)
@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """The outcome of step ``step``; step_done already covers it when this is sent.

    ``rejected``: the plan was malformed (``error`` says how); no block was touched.
    ``cancelled``: its fence was not reached in time and its epoch had passed.
    ``failed``: it ran and raised (``error`` says what): its blocks hold nothing usable.
    """

    step: int
    epoch: int  # the plan's epoch: results of an older epoch are dropped by the engine
    rank: int  # the Worker rank that ran it (rank 0's result carries the sampled tokens)
    status: StepStatus
    sampled: Sampled = Sampled()  # a row per piece with sample=True, in piece order
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()  # of the pieces whose request asked
    error: str = ""
    wait_ns: int = 0  # time spent waiting for the fence
    exec_ns: int = 0  # time spent running the model


TO_WORKER.register(StepOp, tag=1)
TO_WORKER.register(Resync, tag=2)

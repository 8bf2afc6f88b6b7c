"""The channels between the Engine and the Workers: one registry per direction.

``TO_WORKER`` (engine -> worker) carries step plans; ``FROM_WORKER`` (worker ->
engine) carries the worker's announcement and step results. Every message names
its step number ``s`` (the step lane's sequence number, DESIGN.md "Sequence
numbers, watermarks, fences") and the issuer's epoch, and a plan carries its fence:
the worker touches no block before every watermark named in the fence has reached
it. KV data never travels here, only block ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ringfence.actors.kv.space import KVHandle
from ringfence.actors.protocol.resync import Resync
from ringfence.cache.fences import Fence
from ringfence.runtime.codec import Registry, message

TO_WORKER = Registry("engine-to-worker")
FROM_WORKER = Registry("worker-to-engine")

StepStatus = Literal["ok", "rejected", "cancelled", "failed"]


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanPiece:
    """One sequence's share of a step: a prefill chunk or one decode token."""

    seq_id: int  # the engine's id of the sequence (request), echoed in the output
    token_ids: tuple[int, ...]  # tokens at positions start .. start + len - 1
    start: int  # positions 0 .. start - 1 are already in the sequence's blocks
    block_table: tuple[int, ...]  # device block ids covering positions 0 .. start + len - 1
    sample: bool  # True when this piece ends the prompt or decodes: return the next token
    temperature: float = 0.0  # 0: greedy
    seed: int = 0  # with the position, seeds the sampler (a replayed step picks the same)


@message(TO_WORKER, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    """Step ``step`` of the step lane: write ``poison`` blocks with NaN, then run ``pieces``."""

    step: int  # 1, 2, ...: the worker runs step s only after s - 1
    epoch: int  # the issuer's epoch, echoed in the result
    fence: Fence  # the swap_done/store_done values to wait for (its step field is 0)
    pieces: tuple[PlanPiece, ...]
    poison: tuple[int, ...] = ()  # freed device blocks to fill with NaN (cache.poison_freed)


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    """What the engine needs to know about the worker's model."""

    model_id: str  # weights identity (the block keys' fingerprint uses it)
    vocab_size: int
    max_position: int
    dtype: str
    bos_token_id: int | None
    eos_token_id: int | None


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
    logprob: float  # under the raw logits (temperature 1)


@message(FROM_WORKER, tag=2)
@dataclass(frozen=True, slots=True, kw_only=True)
class StepResult:
    """The outcome of step ``step``; step_done already covers it when this is sent.

    ``rejected``: the plan was malformed (``error`` says how); no block was touched.
    ``cancelled``: its fence was not reached in time and its epoch had passed.
    ``failed``: it ran and raised (``error`` says what): its blocks hold nothing usable.
    """

    step: int
    epoch: int  # the plan's epoch: results of an older epoch are dropped by the engine
    status: StepStatus
    outputs: tuple[SampledToken, ...] = ()  # one per piece with sample=True, in piece order
    error: str = ""
    wait_ns: int = 0  # time spent waiting for the fence
    exec_ns: int = 0  # time spent running the model


TO_WORKER.register(Resync, tag=2)

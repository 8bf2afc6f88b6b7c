"""The protocol between the Engine and the Workers: one registry per direction.

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

from ringfence.actors.kvspace import KVHandle
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


# The Transfer lanes: engine -> swap lane (TO_SWAP), engine -> store lane (TO_STORE),
# and back from either (FROM_TRANSFER).

TO_SWAP = Registry("engine-to-swap")
TO_STORE = Registry("engine-to-store")
FROM_TRANSFER = Registry("transfer-to-engine")

OpStatus = Literal["ok", "rejected", "cancelled", "failed"]


@message(TO_SWAP, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceTier:
    """The device KV tensor the swap lane copies to and from, valid from ``epoch`` on.

    Sent after every WorkerReady: swap ops of an older epoch name blocks of a device
    tier that has been reset since, and are cancelled.
    """

    epoch: int
    kv: KVHandle


@message(TO_SWAP, tag=2)
@dataclass(frozen=True, slots=True, kw_only=True)
class SwapOp:
    """Swap op ``op``: copy device block ``device_blocks[i]`` to or from ``host_blocks[i]``."""

    op: int  # 1, 2, ...: the swap lane's sequence number
    epoch: int
    fence: Fence  # step_done and store_done values to wait for (its swap field is 0)
    direction: Literal["in", "out"]  # in: host -> device; out: device -> host
    device_blocks: tuple[int, ...]
    host_blocks: tuple[int, ...]


@message(TO_STORE, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class StoreOp:
    """Store op ``op``: write host blocks to storage under ``keys``, or read them back."""

    op: int  # 1, 2, ...: the store lane's sequence number
    epoch: int
    fence: Fence  # swap_done values to wait for (its store field is 0)
    direction: Literal["write", "read"]  # write-back (host -> storage) or prefetch
    host_blocks: tuple[int, ...]
    keys: tuple[str, ...]  # hex of each block's 16-byte content key


@message(FROM_TRANSFER, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class LaneReady:
    """Sent by each Transfer lane on every start, with the watermark it resumes from."""

    lane: Literal["swap", "store"]
    rank: int
    epoch: int
    incarnation: int
    done: int
    host: KVHandle  # the host KV tensor (the same segment for both lanes)
    resync: int = -1  # the epoch of the engine's Resync this answers; -1: sent on start


@message(FROM_TRANSFER, tag=2)
@dataclass(frozen=True, slots=True, kw_only=True)
class OpDone:
    """The outcome of a swap or store op; the lane's watermark already covers it.

    ``missing`` (prefetch only) lists the positions in the op's blocks that storage
    did not have whole and valid: those host blocks hold nothing usable.
    """

    lane: Literal["swap", "store"]
    op: int
    epoch: int
    status: OpStatus
    error: str = ""
    missing: tuple[int, ...] = ()
    blocks: int = 0
    bytes: int = 0
    wait_ns: int = 0
    copy_ns: int = 0


@message(TO_WORKER, tag=2)
@message(TO_SWAP, tag=3)
@message(TO_STORE, tag=2)
@dataclass(frozen=True, slots=True, kw_only=True)
class Resync:
    """From an engine that has just started: announce yourself again (``WorkerReady`` or
    ``LaneReady`` with ``resync = epoch``) once every message before this one on the
    ring has been handled. The answer's watermark then covers every op an engine
    before this one sent: a restarted engine numbers its ops from there.
    """

    epoch: int  # the engine's epoch, echoed in the answer

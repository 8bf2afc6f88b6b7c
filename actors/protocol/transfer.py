"""The channels between the Engine and the Transfer lanes: engine -> swap lane (``TO_SWAP``),
engine -> store lane (``TO_STORE``), and back from either (``FROM_TRANSFER``).

The ops are the scheduler's own :class:`~ringfence.sched.ops.SwapOp` and
:class:`~ringfence.sched.ops.StoreOp`. Every op names its lane number (``t`` for swap,
``u`` for store, docs/design.md, "Sequence numbers, watermarks, fences"), the issuer's epoch and
its fence; a completion is sent only once the lane's watermark covers the op. KV data
never travels here, only block ids and content keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ringfence.actors.kv.space import KVHandle
from ringfence.actors.protocol.resync import Resync
from ringfence.runtime.codec import Registry, message
from ringfence.sched.ops import StoreOp, SwapOp

TO_SWAP = Registry("engine-to-swap")
TO_STORE = Registry("engine-to-store")
FROM_TRANSFER = Registry("transfer-to-engine")

OpStatus = Literal["ok", "rejected", "cancelled", "failed"]
# How the error of a completion starts when a restarted lane resends it for an op whose
# report went with the crashed incarnation: the lane cannot know how the op ended, so it
# reports it failed (a prefetch: every block missing).
LOST = "completion lost in a restart"


@message(TO_SWAP, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceTier:
    """The device KV tensor the swap lane copies to and from, valid from ``epoch`` on.

    Sent after every WorkerReady: swap ops of an older epoch name blocks of a device
    tier that has been reset since, and are cancelled.
    """

    epoch: int
    kv: KVHandle


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
    rank: int  # the rank whose lane did it: the engine counts an op complete on every rank
    status: OpStatus
    error: str = ""
    missing: tuple[int, ...] = ()
    blocks: int = 0
    bytes: int = 0
    wait_ns: int = 0
    copy_ns: int = 0


TO_SWAP.register(SwapOp, tag=2)
TO_SWAP.register(Resync, tag=3)
TO_STORE.register(StoreOp, tag=1)
TO_STORE.register(Resync, tag=2)

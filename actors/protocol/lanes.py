"""The ``lanes`` counter block: every rank's lane watermarks, epochs and step gate.

The block is shared memory of the run (a :class:`~ringfence.shm.counter.CounterBlock`
that the topology declares), read by the Engine and by every lane executor, and part of
the protocol as much as the messages are: an op's fence names values of these counters.
It holds :data:`LANE_SLOTS` counters per rank, each with one writer:

====  ===============  ===================================================================
slot  counter          writer
====  ===============  ===================================================================
0     ``step_done``    the Worker of the rank: every step <= it has finished
1     ``swap_done``    the swap lane of the rank
2     ``store_done``   the store lane of the rank
3     ``tier_epoch``   the Worker, first thing on every start: ops of older epochs are stale
4     ``issuer_epoch`` the Engine, when it starts: ops of older epochs are stale
5     ``step_gate``    the Worker: the step it committed to run (``executors/ranks.py``)
====  ===============  ===================================================================

Rank r's counters are slots ``r * LANE_SLOTS`` to ``r * LANE_SLOTS + 5``. What the
executors do with them is in ``actors/executors/lanes.py`` (watermarks, fence waits,
stale epochs) and ``actors/executors/ranks.py`` (the step gate).
"""

from __future__ import annotations

from ringfence.cache.fences import Lane
from ringfence.shm.counter import CounterBlock, Watermark

LANES = "lanes"  # the topology's counter block of the lane watermarks
LANE_SLOTS = 6  # counters per rank (see the module docstring)
_LANE_SLOT = {Lane.STEP: 0, Lane.SWAP: 1, Lane.STORE: 2}
TIER_EPOCH, ISSUER_EPOCH = "tier", "issuer"  # the epoch counters
_EPOCH_SLOT = {TIER_EPOCH: 3, ISSUER_EPOCH: 4}
GATE_SLOT = 5  # the step gate


def lane_counter(block: CounterBlock, rank: int, lane: Lane) -> Watermark:
    """The watermark of ``lane`` at ``rank`` in the ``lanes`` counter block."""
    index = rank * LANE_SLOTS + _LANE_SLOT[lane]
    if index >= block.count:
        raise ValueError(f"rank {rank} has no {lane} watermark in a block of {block.count}")
    return block[index]


def epoch_counter(block: CounterBlock, rank: int, which: str) -> Watermark:
    """``tier_epoch`` (the Worker writes it) or ``issuer_epoch`` (the Engine) of ``rank``."""
    index = rank * LANE_SLOTS + _EPOCH_SLOT[which]
    if index >= block.count:
        raise ValueError(f"rank {rank} has no {which} epoch in a block of {block.count}")
    return block[index]


def gate_counter(block: CounterBlock, rank: int) -> Watermark:
    """``step_gate`` of ``rank`` in the ``lanes`` counter block."""
    index = rank * LANE_SLOTS + GATE_SLOT
    if index >= block.count:
        raise ValueError(f"rank {rank} has no step gate in a block of {block.count}")
    return block[index]

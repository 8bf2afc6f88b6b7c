"""A prefill instance's hand-overs: a finished request's full blocks written to storage for
a decode instance, and how many of them are durable once written (docs/design.md,
"Instances (prefill/decode disaggregation)").

:class:`HandOvers` issues the writes when the scheduler finishes a request with
``handover`` on (through the block manager's staging, so they are fenced after the step
that computed the blocks), keeps a :class:`HandOver` for the engine to take, and answers
:meth:`HandOvers.stored_blocks` once the engine saw the writes' last store op complete.
Owned by one scheduler; not thread-safe; no I/O.
"""

from __future__ import annotations

from ringfence.cache.fences import Lane
from ringfence.sched.blocks import BlockManager
from ringfence.sched.pieces import PieceMaker
from ringfence.sched.sequence import HandOver, Sequence


class HandOvers:
    """See the module docstring."""

    def __init__(self, blocks: BlockManager, pieces: PieceMaker, block_size: int) -> None:
        self._blocks = blocks
        self._pieces = pieces
        self._bs = block_size
        self._taken: list[HandOver] = []  # since the last take

    def write(self, seq: Sequence) -> None:
        """Write the finished sequence's full blocks to storage, while it still holds them."""
        r = seq.request
        full = r.num_computed_tokens // self._bs
        keys = self._pieces.keys(seq, r.all_token_ids, full)
        done = self._blocks.save_all(seq.blocks[:full], keys, "handover")
        own = self._blocks.stored.keys
        self._taken.append(
            HandOver(
                request_id=r.request_id,
                keys=tuple(keys[:done]),
                mark=self._blocks.issuer.last_number(Lane.STORE),
                # Skipped by save: storage had them (another instance wrote them).
                present=frozenset(k for k in keys[:done] if k not in own),
            )
        )

    def take(self) -> list[HandOver]:
        """The requests handed over since the last call, in finish order."""
        taken, self._taken = self._taken, []
        return taken

    def stored_blocks(self, handover: HandOver) -> int:
        """How many leading blocks of ``handover`` storage holds, once its ``mark`` is complete
        (a write that failed took its keys out of the stored set)."""
        stored = self._blocks.stored.keys
        count = 0
        for key in handover.keys:
            if key not in stored and key not in handover.present:
                break
            count += 1
        return count

"""The pieces of the step being built, and the keys of the blocks they fill.

A piece (:class:`ringfence.sched.ops.Piece`) is what one sequence computes in a step.
Making one counts its tokens as computed at once ("free at issue, fence at use") and
queues the blocks it fills up for keying; :meth:`PieceMaker.key_filled` keys them once
the step is issued. Keying waits for the step because a key makes a block findable and
may issue its write-through copy: a copy issued before the step would read the block
before the step writes it, and a piece of the same step must not read what another
piece writes.

Owned by one scheduler; not thread-safe; pure.
"""

from __future__ import annotations

from ringfence.cache.block_hash import block_keys
from ringfence.cache.ids import BlockHash, BlockId
from ringfence.cache.kv_events import KVEventJournal
from ringfence.sched.blocks import BlockManager
from ringfence.sched.ops import Opening, Piece
from ringfence.sched.sequence import Sequence


class PieceMaker:
    """See the module docstring."""

    def __init__(
        self, block_size: int, namespace: bytes, events: KVEventJournal | None = None
    ) -> None:
        """``events``: told each key's parent and tokens as it is computed (KV events)."""
        self._bs = block_size
        self._namespace = namespace
        self._events = events
        self._filled: list[tuple[list[BlockId], list[BlockHash]]] = []  # to key after the step
        self._closed: list[int] = []  # sequences ended since the last step (StepOp.closed)

    def make(self, seq: Sequence, count: int) -> Piece:
        """The piece computing the sequence's next ``count`` tokens, which count as computed
        from now on; the blocks it fills up are queued for keying. The sequence's block
        table must already cover them."""
        r = seq.request
        start = r.num_computed_tokens
        tokens = r.all_token_ids
        end = start + count
        r.num_computed_tokens = end
        self.queue_keys(seq, tokens, end // self._bs)
        return Piece(
            seq_id=seq.seq_id,
            token_ids=tokens[start:end],
            start=start,
            block_table=tuple(seq.blocks[: -(-end // self._bs)]),
            sample=end == len(tokens),
            opening=None if seq.opened else self._opening(seq, tokens, start),
        )

    def make_pending(self, seq: Sequence, step: int) -> Piece:
        """The decode of the token step ``step`` (in flight) samples for the sequence, at
        the position after its known tokens: a placeholder token with ``pending_from``
        (:class:`Piece`). Nothing counts as computed and nothing is queued for keying
        until that token is applied (:meth:`Scheduler.on_step`); the sequence's block
        table must already cover the position, and its Opening was sent already."""
        start = seq.request.num_tokens
        end = start + 1
        return Piece(
            seq_id=seq.seq_id,
            token_ids=(0,),
            start=start,
            block_table=tuple(seq.blocks[: -(-end // self._bs)]),
            sample=True,
            pending_from=step,
        )

    @staticmethod
    def _opening(seq: Sequence, tokens: tuple[int, ...], start: int) -> Opening:
        """What the Worker keeps of the sequence (:class:`Opening`); it is open from now."""
        seq.opened = True
        r = seq.request
        history = tokens[:start] if r.params.needs_history else ()
        return Opening(params=r.params, num_prompt_tokens=r.num_prompt_tokens, history=history)

    def close(self, seq: Sequence) -> None:
        """The sequence ended: the next step tells the Worker to forget what an Opening gave
        it (only for a sequence ever admitted: one never opened left nothing there)."""
        if seq.admissions:
            self._closed.append(seq.seq_id)

    def take_closed(self) -> tuple[int, ...]:
        """The sequences closed since the last call, for the next step's ``closed``."""
        closed, self._closed = tuple(self._closed), []
        return closed

    def keys(self, seq: Sequence, tokens: tuple[int, ...], count: int) -> list[BlockHash]:
        """The keys of the first ``count`` full blocks of the sequence (computed once, kept
        in ``seq.keys``)."""
        have = len(seq.keys)
        if count > have:
            parent = seq.keys[-1] if seq.keys else None
            new = block_keys(
                tokens[have * self._bs : count * self._bs],
                self._bs,
                namespace=self._namespace,
                parent=parent,
                salt=seq.request.cache_salt,  # joins the first block's key only
            )
            if self._events is not None:
                bs = self._bs
                for i, key in enumerate(new, have):
                    self._events.note(key, parent, tuple(tokens[i * bs : (i + 1) * bs]))
                    parent = key
            seq.keys.extend(new)
        return seq.keys[:count]

    def queue_keys(self, seq: Sequence, tokens: tuple[int, ...], full: int) -> None:
        """Queue the sequence's blocks not keyed yet, up to ``full``, for
        :meth:`key_filled` (see the module docstring for why they wait)."""
        if full > seq.num_keyed:
            keys = self.keys(seq, tokens, full)
            self._filled.append((seq.blocks[seq.num_keyed : full], keys[seq.num_keyed : full]))
            seq.num_keyed = full

    def key_filled(self, blocks: BlockManager) -> None:
        """Key the queued blocks, in the order they were queued (:meth:`BlockManager.filled`:
        it may issue their copies); call once the step that fills them is issued."""
        for table, keys in self._filled:
            blocks.filled(table, keys)
        self._filled.clear()

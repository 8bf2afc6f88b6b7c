"""Admission: waiting sequences onto the device, and the prefetches that stage them.

The admission path of :class:`ringfence.sched.scheduler.Scheduler`, a module of its own
because it is the one part of a round with its own state (the prefetches in flight,
the admission count) and its own contract: the scheduler hands it the waiting queue,
the running list and what is left of the step's token budget, and gets back the pieces
of the sequences it admitted.

Waiting sequences are taken first come first served, while the budget, ``max_num_seqs``
and the free device blocks allow: a sequence that does not fit stops admission (nobody
overtakes it; admission never preempts), one waiting for its prefetch is passed over.
A sequence's longest cached prefix (:meth:`BlockManager.match`) decides how it starts:
device hits take references, host hits (and a swap-preempted sequence's held blocks)
become swap-ins, storage hits become a prefetch into host blocks, and the sequence
waits for its completion; the blocks that came are then held on host, and the first
that failed and every one after are recomputed, never fetched again.

Owned by one scheduler; not thread-safe; pure.
"""

from __future__ import annotations

from collections import deque

from ringfence.cache.ids import BlockHash, BlockId
from ringfence.cache.prefix_index import PrefixMatch
from ringfence.sched.blocks import BlockManager
from ringfence.sched.config import SchedulerConfig
from ringfence.sched.ops import Piece
from ringfence.sched.pieces import PieceMaker
from ringfence.sched.request import RequestState
from ringfence.sched.sequence import Counters, Journal, Sequence, Tail


class Admission:
    """See the module docstring."""

    def __init__(
        self,
        config: SchedulerConfig,
        blocks: BlockManager,
        pieces: PieceMaker,
        counters: Counters,
        journal: Journal,
    ) -> None:
        self.config = config
        self.blocks = blocks
        self._pieces = pieces
        self._counters = counters
        self._journal = journal
        self._bs = config.tiers.block_size
        # Store op -> the sequence it fetches for: the prefetches issued and not completed,
        # nor given up (drop_prefetch). The scheduler reads it to route completions.
        self.prefetches: dict[int, Sequence] = {}
        self._admitted = 0

    def admit(
        self,
        waiting: deque[Sequence],
        running: list[Sequence],
        budget: int,
        pieces: list[Piece],
        scheduled: set[int],
    ) -> int:
        """Admit waiting sequences (or start their prefetches) within ``budget`` tokens; returns
        the budget left. An admitted sequence leaves ``waiting`` for the end of ``running``
        (state RUNNING), its first piece appended to ``pieces`` and its id to ``scheduled``."""
        for seq in list(waiting):
            if budget == 0 or len(running) >= self.config.sched.max_num_seqs:
                break
            if _prefetching(seq):
                continue  # waits for its prefetch; later requests may go on
            piece = self._start(seq, budget, running)
            if piece is None:
                if _prefetching(seq):
                    continue
                break  # first come first served: nobody overtakes a request that does not fit
            waiting.remove(seq)
            pieces.append(piece)
            scheduled.add(seq.seq_id)
            budget -= len(piece.token_ids)
        return budget

    def _start(self, seq: Sequence, budget: int, running: list[Sequence]) -> Piece | None:
        """Admit ``seq`` with a first piece, or start its prefetch, or None if it does not fit."""
        r = seq.request
        tokens = r.all_token_ids
        limit = (len(tokens) - 1) // self._bs  # leave at least one token to compute
        if r.params.prompt_logprobs is not None:
            # Its prompt's log probabilities come from computing every prompt token (as
            # vLLM does, such a request takes no cache hit); it is never swapped or saved.
            limit = 0
        keys = self._pieces.keys(seq, tokens, limit)
        match = self.blocks.match(keys, seq.storage_until)
        stored = [i for i, w in enumerate(match.where) if w == "storage"]
        if stored:
            if self._start_prefetch(seq, [match.keys[i] for i in stored], stored):
                return None
            end = stored[0]  # no room to stage them: recompute from the first
            match = type(match)(match.keys[:end], match.where[:end], match.block_ids[:end])
        hits = len(match.keys)
        tail = seq.tail if seq.tail is not None and seq.tail.position == hits else None
        cached = hits * self._bs + (tail.num_tokens if tail else 0)
        count = min(len(tokens) - cached, budget)
        on_device = match.count("device")
        need = -(-(cached + count) // self._bs) - on_device
        self.blocks.acquire(match)
        new = self.blocks.allocate_device(need)
        if new is None:
            self.blocks.release(match)
            return None
        table, swap_host, swap_device = _place(match, tail, new)
        self.blocks.swap_in(swap_host, swap_device, "resume" if seq.admissions else "admit")
        # Only once the swap-in is issued: the host blocks may be reused; their next
        # writer waits for it (I4).
        self.blocks.release_host_hits(match)
        self.blocks.release_host(seq.take_holds())
        seq.blocks = table
        seq.num_keyed = 0  # device hits keep their keys; swapped-in ones get theirs below
        r.num_computed_tokens = cached
        self._pieces.queue_keys(seq, tokens, hits)
        self._count_hits(seq, match.where, match.keys, tail)
        if self._journal.enabled:
            where = [
                "storage" if k in seq.from_storage else w
                for w, k in zip(match.where, match.keys, strict=True)
            ]
            self._journal.record(
                "resume" if seq.admissions else "admit",
                seq,
                computed=cached,
                device=where.count("device") * self._bs,
                host=where.count("host") * self._bs + (tail.num_tokens if tail else 0),
                storage=where.count("storage") * self._bs,
            )
        r.transition(RequestState.RUNNING)
        seq.admitted = self._admitted
        self._admitted += 1
        seq.admissions += 1
        running.append(seq)
        return self._pieces.make(seq, count)

    def _count_hits(
        self,
        seq: Sequence,
        where: tuple[str, ...],
        keys: tuple[BlockHash, ...],
        tail: Tail | None,
    ) -> None:
        first = seq.admissions == 0
        for found, key in zip(where, keys, strict=True):
            tier = "storage" if key in seq.from_storage else found
            self._counters.hit_tokens[tier] += self._bs
            if first:
                seq.request.cached_tokens[tier] += self._bs
        if tail is not None:
            self._counters.hit_tokens["host"] += tail.num_tokens

    def _start_prefetch(self, seq: Sequence, keys: list[BlockHash], positions: list[int]) -> bool:
        host = self.blocks.allocate_host(len(keys))
        if host is None:
            return False
        op = self.blocks.prefetch(host, keys)
        seq.prefetch = (op.op, tuple(host), tuple(positions))
        self.prefetches[op.op] = seq
        seq.request.transition(RequestState.WAITING_FOR_PREFETCH)
        self._journal.record("prefetch", seq, op=op.op, blocks=len(keys))
        return True

    def prefetched(self, op: int, status: str, missing: set[int]) -> None:
        """Apply the completion of prefetch ``op`` (one of :attr:`prefetches`): its sequence
        waits again (state WAITING), holding on host, findable under their keys, the blocks
        before the first one that failed or is ``missing``; those from there on are released
        and, from that block on, the sequence is never fetched from storage again."""
        seq = self.prefetches.pop(op)
        assert seq.prefetch is not None
        _, host, positions = seq.prefetch
        seq.prefetch = None
        lacking = set(range(len(host))) if status != "ok" else missing
        first_bad = min(lacking, default=len(host))
        keys = [seq.keys[p] for p in positions[:first_bad]]
        # The duplicates the good blocks leave are handed back before the bad blocks.
        seq.held.extend(self.blocks.hold_on_host(host[:first_bad], keys))
        seq.from_storage.update(keys)
        if first_bad < len(host):
            seq.storage_until = positions[first_bad]
        self.blocks.release_host(host[first_bad:])
        seq.request.transition(RequestState.WAITING)

    def drop_prefetch(self, seq: Sequence) -> None:
        """Give up the sequence's prefetch, if it has one: its host blocks are released (free
        at issue: their next writer waits for the read, I4) and its completion, should it
        still come, is no longer routed here. The sequence's state is the caller's."""
        if seq.prefetch is not None:
            self.blocks.release_host(seq.prefetch[1])
            self.prefetches.pop(seq.prefetch[0], None)
            seq.prefetch = None


def _place(
    match: PrefixMatch, tail: Tail | None, new: list[BlockId]
) -> tuple[list[BlockId], list[BlockId], list[BlockId]]:
    """The device block table of an admission (device hits in place, new blocks for the
    rest), and the host -> device pairs to swap in (host hits, then the held tail)."""
    table: list[BlockId] = []
    fresh = iter(new)
    swap_host: list[BlockId] = []
    swap_device: list[BlockId] = []
    for where, block in zip(match.where, match.block_ids, strict=True):
        assert block is not None
        if where == "device":
            table.append(block)
        else:
            target = next(fresh)
            table.append(target)
            swap_host.append(block)
            swap_device.append(target)
    if tail is not None:
        target = next(fresh)
        table.append(target)
        swap_host.append(tail.host_block)
        swap_device.append(target)
    table.extend(fresh)
    return table, swap_host, swap_device


def _prefetching(seq: Sequence) -> bool:
    return seq.prefetch is not None

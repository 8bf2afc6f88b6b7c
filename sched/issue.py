"""Fenced op issue: the numbers, fences and outgoing list of the scheduler's ops.

:class:`Issuer` numbers each op on its lane (from the first numbers the engine gives, after
the watermarks its executors answered with), asks the :class:`FenceTracker` for its fence
at once, and appends it to the outgoing list that :meth:`Issuer.take_ops` hands to the
engine. Numbers, fences and the list all follow the order of the calls: that order is what
the block manager (:mod:`sched.blocks`) relies on for every ordering it needs (its module
docstring says which). Transfer ops stay in ``inflight`` until their completion, and
:class:`Moved` counts what they move.

Owned by one block manager; not thread-safe; no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ringfence.cache.fences import FenceTracker, Lane
from ringfence.cache.ids import BlockHash, BlockId, Seq
from ringfence.sched.ops import Op, Piece, Reason, StepOp, StoreOp, SwapOp


@dataclass(slots=True)
class Moved:
    """Counters of what the issued ops move, by lane and direction."""

    ops: Counter[str] = field(default_factory=Counter)  # "swap_out", "prefetch", ...
    blocks: Counter[str] = field(default_factory=Counter)


_NAMES = {("in", Lane.SWAP): "swap_in", ("out", Lane.SWAP): "swap_out"}
_NAMES |= {("write", Lane.STORE): "write_back", ("read", Lane.STORE): "prefetch"}


class Issuer:
    """See the module docstring. The engine reads ``inflight`` and ``moved``; the engine's
    trace takes each op's declared sets from ``tracker`` (``keep_access``)."""

    def __init__(
        self,
        block_size: int,
        tracker: FenceTracker,
        first_numbers: Mapping[Lane, int] | None = None,
    ) -> None:
        self.block_size = block_size
        self.tracker = tracker
        self.moved = Moved()
        self.inflight: dict[tuple[Lane, int], SwapOp | StoreOp] = {}  # issued, not completed
        self._out: list[Op] = []
        self._next = {lane: 1 for lane in Lane} | dict(first_numbers or {})

    def take_ops(self) -> list[Op]:
        """The ops issued since the last call, in issue order; clears the list."""
        out, self._out = self._out, []
        return out

    @property
    def has_ops(self) -> bool:
        """Whether ops were issued since the last :meth:`take_ops`."""
        return bool(self._out)

    def last_number(self, lane: Lane) -> int:
        """The number of the last op issued on ``lane`` (0 before the first)."""
        return self._next[lane] - 1

    def _number(self, lane: Lane) -> Seq:
        seq = self._next[lane]
        self._next[lane] = seq + 1
        return Seq(seq)

    def step(
        self, pieces: Sequence[Piece], closed: tuple[int, ...], poison: tuple[int, ...]
    ) -> StepOp:
        """The step running ``pieces``: it reads every block of each piece's table up to the
        piece's end and writes those its tokens fall in, and writes the ``poison`` blocks."""
        reads: set[BlockId] = set(BlockId(b) for b in poison)
        writes: set[BlockId] = set(reads)
        bs = self.block_size
        for p in pieces:
            table = p.block_table
            end = p.start + len(p.token_ids)
            reads.update(BlockId(b) for b in table[: -(-end // bs)])
            writes.update(BlockId(b) for b in table[p.start // bs : -(-end // bs)])
        step = self._number(Lane.STEP)
        fence = self.tracker.issue(Lane.STEP, step, read_device=reads, write_device=writes)
        op = StepOp(step=step, fence=fence, pieces=tuple(pieces), poison=poison, closed=closed)
        self._out.append(op)
        return op

    def swap(
        self, direction: str, device: Sequence[BlockId], host: Sequence[BlockId], reason: Reason
    ) -> SwapOp:
        """A swap-out (device blocks read, host blocks written) or swap-in (the reverse)."""
        seq = self._number(Lane.SWAP)
        if direction == "out":
            fence = self.tracker.issue(Lane.SWAP, seq, read_device=device, write_host=host)
        else:
            fence = self.tracker.issue(Lane.SWAP, seq, read_host=host, write_device=device)
        op = SwapOp(
            op=seq,
            fence=fence,
            direction="out" if direction == "out" else "in",
            device_blocks=tuple(device),
            host_blocks=tuple(host),
            reason=reason,
        )
        self._record(op, len(device))
        return op

    def store(
        self, direction: str, host: Sequence[BlockId], keys: Sequence[BlockHash], reason: Reason
    ) -> StoreOp:
        """A write-back (host blocks read) or prefetch (host blocks written) of ``keys``."""
        seq = self._number(Lane.STORE)
        if direction == "write":
            fence = self.tracker.issue(Lane.STORE, seq, read_host=host)
        else:
            fence = self.tracker.issue(Lane.STORE, seq, write_host=host)
        op = StoreOp(
            op=seq,
            fence=fence,
            direction="write" if direction == "write" else "read",
            host_blocks=tuple(host),
            keys=tuple(keys),
            reason=reason,
        )
        self._record(op, len(host))
        return op

    def _record(self, op: SwapOp | StoreOp, blocks: int) -> None:
        """An issued transfer op: counted, in flight until its completion, out to the engine."""
        name = _NAMES[(op.direction, op.lane)]
        self.moved.ops[name] += 1
        self.moved.blocks[name] += blocks
        self.inflight[(op.lane, op.number)] = op
        self._out.append(op)

    def completed(self, lane: Lane, number: int) -> SwapOp | StoreOp | None:
        """The transfer op completed now, no longer in flight; None if it was not."""
        return self.inflight.pop((lane, number), None)

"""Fenced op issue: the numbers, fences and outgoing list of the scheduler's ops.

:class:`Issuer` numbers each op on its lane (from the first numbers the engine gives, after
the watermarks its executors answered with), asks the :class:`FenceTracker` for its fence
at once, and appends it to the outgoing list that :meth:`Issuer.take_ops` hands to the
engine. Numbers, fences and the list all follow the order of the calls: that order is what
the block manager (:mod:`sched.blocks`) relies on for every ordering it needs (its module
docstring says which). Transfer ops stay in ``inflight`` until their completion, and
:class:`Moved` counts what they move.

Swap-outs issued back to back for one reason are one op. A scheduling round that grows
many sequences by a block evicts a block for each (write-back) or fills one for each
(write-through); as separate ops, each costs the swap lane a message, a copy call and a
completion, and each holds a credit of the lane. So a swap-out is gathered, not numbered,
and the gathering is issued as one op (numbered and fenced then, its blocks in call order)
as soon as anything else happens: another op of any lane or reason, a swap-out that names
a block the gathering already names (a host block reused within the round must be
written in call order, and an op writes each block once), :meth:`Issuer.take_ops`, or a
question about what was issued. Nothing was issued between its parts, so the op sits in
issue order exactly where each part would have, and its fence, the largest of the other
lanes' numbers its blocks need, is the largest of the parts' fences: the protocol sees a
sequence of consecutive swap-outs as the one op that does all of them, in order.

Owned by one block manager; not thread-safe; no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Literal, cast

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


@dataclass(slots=True)
class _Gathering:
    """Swap-outs of one reason not yet issued (see the module docstring)."""

    reason: Reason
    device: list[BlockId] = field(default_factory=list)
    host: list[BlockId] = field(default_factory=list)

    def names_any(self, device: Sequence[BlockId], host: Sequence[BlockId]) -> bool:
        return not (set(self.device).isdisjoint(device) and set(self.host).isdisjoint(host))


class Issuer:
    """See the module docstring. The engine reads ``inflight`` and ``moved`` (after
    :meth:`take_ops`); the engine's trace takes each op's declared sets from ``tracker``
    (``keep_access``)."""

    def __init__(
        self,
        block_size: int,
        tracker: FenceTracker,
        first_numbers: Mapping[Lane, int] | None = None,
    ) -> None:
        self.block_size = block_size
        self.tracker = tracker
        self.moved = Moved()
        self._inflight: dict[tuple[Lane, int], SwapOp | StoreOp] = {}  # issued, not completed
        self._out: list[Op] = []
        self._next = {lane: 1 for lane in Lane} | dict(first_numbers or {})
        self._gathering: _Gathering | None = None

    def take_ops(self) -> list[Op]:
        """The ops issued since the last call, in issue order; clears the list."""
        self.seal()
        out, self._out = self._out, []
        return out

    @property
    def has_ops(self) -> bool:
        """Whether ops were issued since the last :meth:`take_ops`."""
        return bool(self._out) or self._gathering is not None

    @property
    def inflight(self) -> dict[tuple[Lane, int], SwapOp | StoreOp]:
        """The transfer ops issued and not yet completed, by (lane, number)."""
        self.seal()
        return self._inflight

    def last_number(self, lane: Lane) -> int:
        """The number of the last op issued on ``lane`` (0 before the first)."""
        self.seal()
        return self._next[lane] - 1

    def seal(self) -> None:
        """Issue the swap-outs gathered so far as one op (see the module docstring)."""
        gathering, self._gathering = self._gathering, None
        if gathering is None:
            return
        self._swap_op("out", gathering.device, gathering.host, gathering.reason)

    def _number(self, lane: Lane) -> Seq:
        seq = self._next[lane]
        self._next[lane] = seq + 1
        return Seq(seq)

    def step(
        self, pieces: Sequence[Piece], closed: tuple[int, ...], poison: tuple[int, ...]
    ) -> StepOp:
        """The step running ``pieces``: it reads every block of each piece's table up to the
        piece's end and writes those its tokens fall in, and writes the ``poison`` blocks."""
        self.seal()
        # Block ids as the tables hold them (BlockId is an int at run time): sets built
        # from slices, not an id at a time, are most of this method at 256 pieces. The
        # reads are a frozenset: the tracker keeps them until the next step.
        writes: set[int] = set(poison)
        tables = []
        bs = self.block_size
        for p in pieces:
            table, start = p.block_table, p.start
            last = -(-(start + len(p.token_ids)) // bs)
            tables.append(table[:last])
            writes.update(table[start // bs : last])
        reads = frozenset(chain(poison, *tables))
        step = self._number(Lane.STEP)
        fence = self.tracker.issue(
            Lane.STEP,
            step,
            read_device=cast("frozenset[BlockId]", reads),
            write_device=cast("set[BlockId]", writes),
        )
        op = StepOp(step=step, fence=fence, pieces=tuple(pieces), poison=poison, closed=closed)
        self._out.append(op)
        return op

    def swap(
        self, direction: str, device: Sequence[BlockId], host: Sequence[BlockId], reason: Reason
    ) -> None:
        """A swap-out (device blocks read, host blocks written; gathered with the swap-outs
        issued back to back for the same reason) or swap-in (the reverse)."""
        if len(device) != len(host):
            raise ValueError(f"{len(device)} device blocks but {len(host)} host blocks")
        if direction == "out":
            gathering = self._gathering
            if gathering is not None and (
                gathering.reason != reason or gathering.names_any(device, host)
            ):
                self.seal()
                gathering = None
            if gathering is None:
                gathering = self._gathering = _Gathering(reason)
            gathering.device.extend(device)
            gathering.host.extend(host)
            return
        self.seal()
        self._swap_op("in", device, host, reason)

    def _swap_op(
        self,
        direction: Literal["in", "out"],
        device: Sequence[BlockId],
        host: Sequence[BlockId],
        reason: Reason,
    ) -> None:
        """Number, fence and record one swap op (a swap-out reads the device blocks and
        writes the host blocks, a swap-in the reverse)."""
        seq = self._number(Lane.SWAP)
        if direction == "out":
            fence = self.tracker.issue(Lane.SWAP, seq, read_device=device, write_host=host)
        else:
            fence = self.tracker.issue(Lane.SWAP, seq, read_host=host, write_device=device)
        op = SwapOp(
            op=seq,
            fence=fence,
            direction=direction,
            device_blocks=tuple(device),
            host_blocks=tuple(host),
            reason=reason,
        )
        self._record(op, len(device))

    def store(
        self, direction: str, host: Sequence[BlockId], keys: Sequence[BlockHash], reason: Reason
    ) -> StoreOp:
        """A write-back (host blocks read) or prefetch (host blocks written) of ``keys``."""
        self.seal()
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
        self._inflight[(op.lane, op.number)] = op
        self._out.append(op)

    def completed(self, lane: Lane, number: int) -> SwapOp | StoreOp | None:
        """The transfer op completed now, no longer in flight; None if it was not."""
        self.seal()
        return self._inflight.pop((lane, number), None)

"""Fences: which watermarks an op must wait for before it touches its blocks.

Three lanes are each executed in issue order by exactly one executor per rank: ``step``
(the Worker: model steps read and write device blocks), ``swap`` (Transfer: a swap-in
reads host blocks and writes device blocks, a swap-out reads device blocks and writes
host blocks) and ``store`` (Transfer: a write-back reads host blocks, a prefetch writes
host blocks). The Engine is the only issuer of every op number, and each lane has a
watermark: every op of the lane numbered up to it is done.

The rule. For every device block and every host block the tracker remembers, per lane,
the last op that wrote it and the last op that read or wrote it. An op of lane L that
reads blocks R and writes blocks W gets, for each other lane L', the fence value

    max(max(last_writer[L'][b] for b in R), max(last_access[L'][b] for b in W), 0)

and its executor must not touch the blocks until the watermark of every such L' has
reached its value. Readers never wait for readers. The fence has no entry for L itself:
ops of one lane are ordered by the lane's FIFO. The op is then recorded as the last
access (and, for W, the last write) of its blocks in lane L. Storage is keyed by content
hash, so its keys are never reused for other bytes and its ops are idempotent: it
needs no fence. A fence orders ops and says nothing of their outcome: a prefetch can
fail, so the Engine issues nothing that reads prefetched blocks before it has the
prefetch's completion status.

The rule yields the four invariants of DESIGN "Sequence numbers, watermarks, fences":

- I1: a step never reads a device block before the swap-in that fills it is done (the
  step reads the block, whose last swap writer is that swap-in);
- I2: a swap-out never reads a device block before the step that wrote it is done
  (the swap-out reads the block, whose last step writer is that step);
- I3: a swap-in never overwrites a device block that an unfinished step still uses
  (the swap-in writes the block, whose last step access is that step), so a block can
  be handed to a new request the moment it is freed: free at issue, fence at use;
- I4: a write-back never reads a host block before the swap-out that fills it is done,
  and a new swap-out never overwrites a host block that a pending write-back still
  reads (or, by the swap FIFO, that a pending swap-in still reads); likewise a swap-in
  never reads a host block before the prefetch that fills it is done, and a prefetch
  never overwrites a host block that a pending swap-in still reads.

Why the rule is enough: a fence names only ops issued before the op that carries it, so
every wait points back in issue order and no cycle of waits can form (no deadlock); and
two ops of different lanes that touch a common block, at least one of them writing it,
run in issue order, so every execution equals the sequential execution of the ops in
the order they were issued. The later op of such a pair waits for a number at least the
earlier op's (the last writer or last access of the block in that lane), and a
watermark covers every op of its lane up to its value.
"""

from __future__ import annotations

import enum
from array import array
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import NamedTuple, cast

from ringfence.cache.ids import BlockId, Seq


class Lane(enum.StrEnum):
    """A lane of ops; each is executed in issue order by exactly one executor per rank."""

    STEP = "step"  # Worker: model steps, read and write device blocks
    SWAP = "swap"  # Transfer: swap-in (host -> device) and swap-out (device -> host)
    STORE = "store"  # Transfer: write-back (host -> storage) and prefetch (storage -> host)


class Tier(enum.StrEnum):
    """A fenced tier of blocks; each has its own id space (storage is content-addressed)."""

    DEVICE = "device"
    HOST = "host"


_LANES = (Lane.STEP, Lane.SWAP, Lane.STORE)  # the order of the fields of Fence
_LANE_INDEX = {lane: i for i, lane in enumerate(_LANES)}
_STEP, _SWAP = 0, 1  # lane indexes
_TIERS = (Tier.DEVICE, Tier.HOST)  # the order of the per-tier records
_DEVICE = 0  # tier index
# Per tier, each lane whose ops touch it, mapped to the other such lane. Steps never touch
# host blocks and store ops never touch device blocks, so on each tier an op has exactly
# one other lane to wait for, and the tier keeps a record for two lanes only.
_OTHER_LANE = ({0: 1, 1: 0}, {1: 2, 2: 1})
# The blocks an op reads and writes, per tier in the order of _TIERS.
_Blocks = Collection[BlockId]
_PerTier = tuple[tuple[_Blocks, _Blocks], tuple[_Blocks, _Blocks]]
_NO_WAIT_SEQ = Seq(0)  # a fence field that waits for nothing


@dataclass(frozen=True, slots=True, kw_only=True)
class Fence:
    """The watermark value each lane must reach before an op may touch its blocks.

    0 means no wait. The field of the op's own lane is always 0: the lane's FIFO orders
    the op after every earlier op of its lane.
    """

    step: Seq = _NO_WAIT_SEQ  # step_done must reach this
    swap: Seq = _NO_WAIT_SEQ  # swap_done must reach this
    store: Seq = _NO_WAIT_SEQ  # store_done must reach this

    def waits(self) -> dict[Lane, Seq]:
        """The lanes this fence waits for, with their values; empty when it waits for none."""
        pairs = ((Lane.STEP, self.step), (Lane.SWAP, self.swap), (Lane.STORE, self.store))
        return {lane: seq for lane, seq in pairs if seq}


NO_WAIT = Fence()  # the fence of an op that waits for nothing


class Access(NamedTuple):
    """The blocks an op declared to the tracker, sorted: what its fence was computed from.

    The executors touch blocks by the op's own fields (a step's block tables, a swap's
    block lists), not by these sets; ``ringfence replay`` compares the two (an op that
    touches a block it did not declare got a fence that ignores that block).
    """

    seq: int
    read_device: tuple[int, ...]
    write_device: tuple[int, ...]
    read_host: tuple[int, ...]
    write_host: tuple[int, ...]


class FenceTracker:
    """The Engine's per-block record of the last write and last access in every lane.

    Owned by the Engine (one per rank); not thread-safe. Each tier keeps, for each of the
    two lanes that touch it, two flat ``array('q')`` indexed by block id: the number of
    the lane's last op that wrote the block, and of its last op that read or wrote it (0
    for none). That is 32 bytes per block and tier, no per-block objects, and an op costs
    time in the number of blocks it touches only. Plain loops over the block ids are the
    fastest stdlib way to index an array (``map(a.__getitem__, ...)`` was slower).

    Fences of one lane are also monotone: each field is at least the same field of the
    lane's previous fence. That costs no extra wait (the FIFO predecessor already waited
    for it and watermarks never go back) and makes a fence the whole precondition of its
    op, so an executor resuming at any op, or a reader of a trace, needs no earlier op.

    A step reads every block of its sequences' tables, thousands at a large batch, and
    consecutive steps read nearly the same blocks. Two records make a step cost time in
    the blocks that changed since the previous step, not in all it reads; both are exact
    (every fence equals the plain per-block rule's, ``tests/cache/test_fence_records.py``):

    - the step lane's last access is stamped lazily: the last step's read set is kept
      whole, and a block is stamped with that step's number only when a later step no
      longer reads it (a set difference, in C). A block in the kept set was last read by
      the last step; a swap-in that writes one waits for it.
    - a step waits for the swap lane's last write of a block it reads only where that
      write lies above the step lane's floor (the last step's fence on the swap lane):
      the tracker keeps those blocks, a few after a swap-in and none in steady decode,
      and looks them up in the step's read set, instead of looking up every block read.

    With ``keep_access`` (the engine's trace level) it also keeps each op's declared
    :class:`Access` until :meth:`take_access` takes it.
    """

    __slots__ = (
        "_access",
        "_last_issued",
        "_num_blocks",
        "_previous",
        "_previous_fence",
        "_records",
        "_step_reads",
        "_step_reads_seq",
        "_swap_writes",
    )

    def __init__(
        self, num_device_blocks: int, num_host_blocks: int, *, keep_access: bool = False
    ) -> None:
        if num_device_blocks < 0 or num_host_blocks < 0:
            raise ValueError(
                f"block counts must be >= 0: got {num_device_blocks} device, {num_host_blocks} host"
            )
        self._num_blocks = (num_device_blocks, num_host_blocks)  # per tier
        # [tier][lane] -> (last write, last access) per block, for the lanes touching the tier.
        self._records = tuple(
            {lane: (_zeros(n), _zeros(n)) for lane in _OTHER_LANE[t]}
            for t, n in enumerate(self._num_blocks)
        )
        self._last_issued = [0, 0, 0]  # [lane]: the number of the last op issued
        self._previous = [[0, 0, 0] for _ in _LANES]  # [lane]: the lane's last fence, by lane
        # [lane]: the same as a Fence; with monotone fences, consecutive ones are often equal,
        # and reusing the object saves most of the fixed cost of an op.
        self._previous_fence = [NO_WAIT for _ in _LANES]
        # [lane]: the declared sets of the ops issued and not yet taken, in issue order.
        self._access: tuple[deque[Access], ...] | None = (
            tuple(deque() for _ in _LANES) if keep_access else None
        )
        # The last step's read set and number: its reads, not yet stamped (class docstring).
        self._step_reads: frozenset[int] = frozenset()
        self._step_reads_seq = 0
        # Device block -> the swap op that last wrote it, where that lies above the step
        # lane's floor on the swap lane; in issue order, so the oldest come first.
        self._swap_writes: dict[int, int] = {}

    def issue(
        self,
        lane: Lane,
        seq: Seq,
        *,
        read_device: Collection[BlockId] = (),
        write_device: Collection[BlockId] = (),
        read_host: Collection[BlockId] = (),
        write_host: Collection[BlockId] = (),
    ) -> Fence:
        """Compute the fence of op ``seq`` of ``lane``, record the op, and return the fence.

        A block may be both read and written. Mutates the tracker, or nothing when it
        raises ``ValueError``: ``seq`` is not above the last number issued in the lane,
        the lane does not touch a tier it was given blocks of (steps touch only device
        blocks, store ops only host blocks), or a block id is out of range.
        """
        i = _LANE_INDEX[lane]
        if seq <= self._last_issued[i]:
            raise ValueError(
                f"{lane} op numbers must increase: got {seq} after {self._last_issued[i]}"
            )
        if i == _STEP and not isinstance(read_device, frozenset):
            read_device = frozenset(read_device)  # kept until the next step: never changed
        per_tier = ((read_device, write_device), (read_host, write_host))
        waits = self._fence(i, per_tier)
        # Recorded only now: every check above and in _fence passed, so nothing is half done.
        self._last_issued[i] = seq
        if waits != self._previous[i]:
            self._previous[i] = waits
            self._previous_fence[i] = _as_fence(waits)
        for t, (reads, writes) in enumerate(per_tier):
            if reads or writes:
                last_write, last_access = self._records[t][i]
                if i == _STEP:
                    self._keep_step_reads(seq, cast("frozenset[int]", reads), last_access)
                else:
                    for block in reads:
                        last_access[block] = seq
                for block in writes:
                    last_access[block] = seq
                    last_write[block] = seq
                if i == _SWAP and t == _DEVICE:
                    swap_writes = self._swap_writes
                    for block in writes:  # moved to the end: the dict stays in issue order
                        swap_writes.pop(block, None)
                        swap_writes[block] = seq
        if i == _STEP and self._swap_writes:
            self._forget_swap_writes(waits[_SWAP])
        if self._access is not None:
            sets = (read_device, write_device, read_host, write_host)
            self._access[i].append(Access(seq, *(tuple(sorted(b)) for b in sets)))
        return self._previous_fence[i]

    def take_access(self, lane: Lane, seq: int) -> Access | None:
        """The sets op ``seq`` of ``lane`` declared, once (None without ``keep_access``, or
        when it was taken). Ops of a lane are taken in issue order; taking one forgets the
        earlier ones never taken (ops dropped unsent, as at a Worker restart)."""
        if self._access is None:
            return None
        kept = self._access[_LANE_INDEX[lane]]
        while kept and kept[0].seq < seq:
            kept.popleft()
        return kept.popleft() if kept and kept[0].seq == seq else None

    def records(self, tier: Tier, lane: Lane) -> tuple[array[int], array[int]]:
        """The last write and the last access of every ``tier`` block by ``lane``, indexed
        by block id, with the stamps still pending written in (the class docstring)."""
        t, i = _TIERS.index(tier), _LANE_INDEX[lane]
        if t == _DEVICE and i == _STEP and self._step_reads:
            last_access, seq = self._records[t][i][1], self._step_reads_seq
            for block in self._step_reads:
                last_access[block] = seq
            self._step_reads = frozenset()
        return self._records[t][i]

    def _fence(self, i: int, per_tier: _PerTier) -> list[int]:
        """The fence of an op of lane index ``i`` as a list by lane; checks, mutates nothing."""
        waits = list(self._previous[i])  # its own field is always 0
        for t, (reads, writes) in enumerate(per_tier):
            if not reads and not writes:
                continue
            if i not in _OTHER_LANE[t]:
                raise ValueError(f"a {_LANES[i]} op touches no {_TIERS[t]} blocks: got some")
            j = _OTHER_LANE[t][i]
            last_write, last_access = self._records[t][j]
            try:
                # A read waits for the last write; a write waits for the last read or write.
                if t == _DEVICE and i == _STEP:
                    waits[j] = self._step_reads_wait(cast("frozenset[int]", reads), waits[j])
                else:
                    waits[j] = _latest(last_write, reads, waits[j])
                waits[j] = _latest(last_access, writes, waits[j])
                if t == _DEVICE and i == _SWAP:
                    waits[j] = self._last_step_reading(writes, waits[j])
            except IndexError:
                n = self._num_blocks[t]
                bad = sorted({b for b in (*reads, *writes) if not 0 <= b < n})
                raise ValueError(f"{_TIERS[t]} block ids must lie in [0, {n}): got {bad}") from None
        return waits

    def _step_reads_wait(self, reads: frozenset[int], floor: int) -> int:
        """The swap lane's last write of the blocks a step reads, or ``floor`` (the step
        lane's floor on the swap lane) where none lies above it; IndexError for a block id
        out of range. Only the blocks the last step did not read are checked for range:
        the others were checked then."""
        n = self._num_blocks[_DEVICE]
        for block in reads - self._step_reads:
            if not 0 <= block < n:
                raise IndexError(block)
        latest = floor
        for block, seq in self._swap_writes.items():
            if seq > latest and block in reads:
                latest = seq
        return latest

    def _last_step_reading(self, blocks: Collection[BlockId], floor: int) -> int:
        """The last step's number where it read any of ``blocks``, else ``floor``: its
        reads are kept whole, not yet stamped into the step lane's last access."""
        last = self._step_reads_seq
        if last > floor and not self._step_reads.isdisjoint(blocks):
            return last
        return floor

    def _keep_step_reads(self, seq: int, reads: frozenset[int], last_access: array[int]) -> None:
        """Keep step ``seq``'s read set, stamping the blocks the last step read and this
        one does not with the last step's number (the class docstring)."""
        last = self._step_reads_seq
        for block in self._step_reads - reads:
            last_access[block] = last
        self._step_reads, self._step_reads_seq = reads, seq

    def _forget_swap_writes(self, floor: int) -> None:
        """Drop the swap writes at or below the step lane's new floor on the swap lane:
        every later step's fence is at least that, so they can no longer raise it."""
        swap_writes = self._swap_writes
        if floor >= self._last_issued[_SWAP]:
            swap_writes.clear()
            return
        covered = []
        for block, seq in swap_writes.items():  # oldest first
            if seq > floor:
                break
            covered.append(block)
        for block in covered:
            del swap_writes[block]


def _latest(seqs: array[int], blocks: Collection[BlockId], floor: int) -> int:
    """The largest of ``floor`` and ``seqs[b]`` for b in ``blocks``; IndexError out of range.

    A loop, not ``max(map(...))``: its bytecode is specialized, and at a step's thousands of
    blocks (256 sequences) it measured faster than map, which calls ``__getitem__`` per block."""
    latest = floor
    for block in blocks:
        if block < 0:  # an array would silently index from its end
            raise IndexError(block)
        seq = seqs[block]
        if seq > latest:  # noqa: PLR1730 (a call to max() per block costs 3x the loop)
            latest = seq
    return latest


def _as_fence(waits: list[int]) -> Fence:
    return Fence(step=Seq(waits[0]), swap=Seq(waits[1]), store=Seq(waits[2]))


def _zeros(num_blocks: int) -> array[int]:
    """An array of ``num_blocks`` sequence numbers, all 0."""
    return array("q", bytes(8 * num_blocks))

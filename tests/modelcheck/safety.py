"""The fence rule judged by what it must guarantee, not by equality with itself.

F in table mode (tables.py) asserts that the model's fences equal cache/fences.py's on
recorded ops: it fails safe changes too (a fence made stronger, the monotone floor
dropped), and it is tied to the code at one point only. Here the recorded ops are judged
directly by the question the protocol depends on (docs/design.md, "Sequence numbers,
watermarks, fences"): for every pair of ops of different lanes that touch a common block
of a tier, at least one of them writing it, the later op's fence names the earlier op's
lane at least at the earlier op's number (then the lane's FIFO and its watermark order
them). That is :func:`unsafe_pairs`. A fence above what those pairs need is reported by
:func:`over_fenced`, not failed: it costs waiting, never a wrong token.

``CODE_MUTANTS`` are mutants of the code (of ``FenceTracker._fence``), the way configs.py
names mutants of the model: each unsafe one must be caught on some recorded seed; each
safe one must pass every seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from modelcheck.tables import RecordingTracker, Row
from ringfence.cache.fences import _OTHER_LANE, Lane, Tier, _latest, _PerTier  # the rule's

_FIELD = {Lane.STEP: "step", Lane.SWAP: "swap", Lane.STORE: "store"}
_INDEX = {Lane.STEP: 0, Lane.SWAP: 1, Lane.STORE: 2}
_TIERS = (Tier.DEVICE, Tier.HOST)  # the order of _touches
_LANES = (Lane.STEP, Lane.SWAP, Lane.STORE)  # the order of Fence's fields


def _touches(row: Row) -> tuple[tuple[frozenset[int], frozenset[int]], ...]:
    """(reads, writes) per tier (device, host)."""
    return ((row.read_device, row.write_device), (row.read_host, row.write_host))


Resets = Sequence[tuple[int, Tier]]


def _needed(rows: Sequence[Row], k: int, resets: Resets) -> dict[Lane, int]:
    """The least fence op ``k`` needs: per other lane, the largest number of an earlier op
    of that lane that conflicts with it on a block (one of the two writing it). A tier's
    reset (a Worker restart: every older op on it cancelled by its epoch) ends the
    conflicts on that tier of the ops before it."""
    row, need = rows[k], {lane: 0 for lane in _FIELD}
    mine = _touches(row)
    since = [max((n for n, tier in resets if tier is t and n <= k), default=0) for t in _TIERS]
    for e, earlier in enumerate(rows[:k]):
        if earlier.lane is row.lane:
            continue
        for t, ((r1, w1), (r2, w2)) in enumerate(zip(_touches(earlier), mine, strict=True)):
            if e >= since[t] and ((w1 & (r2 | w2)) or (r1 & w2)):
                need[earlier.lane] = max(need[earlier.lane], earlier.seq)
    return need


def unsafe_pairs(rows: Sequence[Row], resets: Resets = ()) -> list[str]:
    """Every op whose fence lets it run before an earlier conflicting op of another lane,
    named with both ops."""
    found = []
    for k, row in enumerate(rows):
        for lane, seq in _needed(rows, k, resets).items():
            have = getattr(row.fence, _FIELD[lane])
            if have < seq:
                found.append(
                    f"op {k} ({row.lane} {row.seq}) waits for {lane} {have}, but {lane} op "
                    f"{seq} touches a block it touches, one of them writing"
                )
    return found


def over_fenced(rows: Sequence[Row], resets: Resets = ()) -> list[tuple[int, Lane, int, int]]:
    """(op index, lane, fence, needed) wherever a fence waits for more than it needs."""
    out = []
    for k, row in enumerate(rows):
        for lane, seq in _needed(rows, k, resets).items():
            have = getattr(row.fence, _FIELD[lane])
            if have > seq:
                out.append((k, lane, have, seq))
    return out


# Mutants of the code: FenceTracker._fence rewritten with one rule changed.


class _PrefetchOnLastWrite(RecordingTracker):
    """A prefetch (a store op writing host blocks) waits for the swap lane's last write of
    its blocks, not their last access: it may overwrite a host block a swap-in still reads
    (I4)."""

    __slots__ = ()

    def _fence(self, i: int, per_tier: _PerTier) -> list[int]:
        return _rule(self, i, per_tier, writes_on_write=(_INDEX[Lane.STORE], 1))


class _SwapInOnLastStepWrite(RecordingTracker):
    """A swap-in (a swap op writing device blocks) waits for the step lane's last write of
    its blocks, not their last access: it may overwrite a block a running step still reads
    (I3)."""

    __slots__ = ()

    def _fence(self, i: int, per_tier: _PerTier) -> list[int]:
        return _rule(self, i, per_tier, writes_on_write=(_INDEX[Lane.SWAP], 0))


class _NoFloor(RecordingTracker):
    """Fences not kept monotone: each one only what its own blocks need (safe)."""

    __slots__ = ()

    def _fence(self, i: int, per_tier: _PerTier) -> list[int]:
        return _rule(self, i, per_tier, floor=False)


class _WaitForEverything(RecordingTracker):
    """Every op waits for every op issued before it in the other lanes (safe, slow)."""

    __slots__ = ()

    def _fence(self, i: int, per_tier: _PerTier) -> list[int]:
        waits = list(self._last_issued)
        waits[i] = 0
        return waits


def _rule(
    tracker: RecordingTracker,
    i: int,
    per_tier: _PerTier,
    *,
    writes_on_write: tuple[int, int] | None = None,
    floor: bool = True,
) -> list[int]:
    """cache/fences.py's rule with one change: for lane ``writes_on_write[0]`` on tier
    ``writes_on_write[1]``, writes wait for the other lane's last write; or no floor."""
    waits = list(tracker._previous[i]) if floor else [0, 0, 0]
    for t, (reads, writes) in enumerate(per_tier):
        if not reads and not writes:
            continue
        j = _OTHER_LANE[t][i]
        last_write, last_access = tracker.records(_TIERS[t], _LANES[j])
        waits[j] = _latest(last_write, reads, waits[j])
        weak = writes_on_write == (i, t)
        waits[j] = _latest(last_write if weak else last_access, writes, waits[j])
    return waits


@dataclass(frozen=True, slots=True)
class CodeMutant:
    name: str
    tracker: type[RecordingTracker]
    safe: bool  # a safe change must pass; an unsafe one must be caught on some seed
    what: str


CODE_MUTANTS = (
    CodeMutant("PREFETCH_ON_LAST_WRITE", _PrefetchOnLastWrite, False,
               "a prefetch waits on the swap lane's last write, not its last access (I4)"),
    CodeMutant("SWAP_IN_ON_LAST_STEP_WRITE", _SwapInOnLastStepWrite, False,
               "a swap-in waits on the step lane's last write, not its last access (I3)"),
    CodeMutant("NO_MONOTONE_FLOOR", _NoFloor, True,
               "fences not kept monotone (safe: each still covers its own blocks)"),
    CodeMutant("WAIT_FOR_EVERYTHING", _WaitForEverything, True,
               "every op waits for everything issued before it (safe, over-fenced)"),
)  # fmt: skip

"""An instance's load as a router follows it: ``GET /ringfence/load?after=N&wait_s=S``.

The engine sends the front end its :class:`Stats` on every tick; the figures a router
weighs (requests running and waiting, device blocks free and in all, requests open in the
front end) are a :class:`Load`. Each time they change, :class:`LoadWatch` numbers the new
one. The route answers at once with the newest if its number is past ``after``, else as
soon as the next change comes, or at ``wait_s`` (a long poll: an idle instance costs a
router one call per ``wait_s``, a busy one at most one per engine tick).

Owned by the front end's event loop: the actor hands each Stats over (``Handoff``).
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import asdict, dataclass
from typing import Any

from ringfence.actors.protocol.client import Stats

MAX_WAIT_S = 30.0  # the longest a caller may ask the route to hold its answer


@dataclass(frozen=True, slots=True, kw_only=True)
class Load:
    """What a router weighs of an instance (zeros before its engine began)."""

    pending: int = 0  # requests open in the front end (not finished)
    running: int = 0  # admitted, with device blocks
    waiting: int = 0  # not admitted yet: new, prefetching, preempted
    reservations: int = 0  # a decode instance's live reservations
    free_blocks: int = 0  # device blocks free (cached ones included: they can be taken)
    total_blocks: int = 0  # device blocks in all

    @classmethod
    def of(cls, stats: Stats | None, pending: int) -> Load:
        if stats is None:
            return cls(pending=pending)
        return cls(
            pending=pending,
            running=stats.running,
            waiting=stats.waiting,
            reservations=stats.reservations,
            free_blocks=stats.free_blocks,
            total_blocks=stats.blocks_total.get("device", 0),
        )

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class LoadWatch:
    """The newest :class:`Load`, numbered from 1 by change (see the module docstring)."""

    def __init__(self) -> None:
        self.seq = 0
        self.load = Load()
        self._changed = asyncio.Event()

    def note(self, load: Load) -> None:
        """A new reading (event-loop thread): numbered if it differs from the last."""
        if load == self.load and self.seq:
            return
        self.seq += 1
        self.load = load
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def after(self, seq: int, wait_s: float) -> tuple[int, Load]:
        """The newest reading once its number is past ``seq``, or at ``wait_s`` (whatever
        it is then)."""
        if self.seq <= seq:
            changed = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(max(wait_s, 0.0), MAX_WAIT_S))
        return self.seq, self.load

    def answer(self, seq: int, load: Load) -> dict[str, Any]:
        return {"seq": seq, **load.as_dict()}

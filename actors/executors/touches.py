"""The blocks one op touched, as its executor recorded them (trace level only).

Each executor records, where it indexes the KV tensors, the blocks it read and wrote: the
Worker from the index tensors its model's step gathered and scattered with (and the
blocks it poisoned), a swap lane from the block lists it copied between, the store lane
from the host blocks it read for a write-back or filled for a prefetch. It logs them as
``op.touched`` (fields ``reads`` and ``writes``: {tier: sorted block ids}, the layout of
``op.issue``'s ``declared``), and ``ringfence replay`` checks that every block touched was
declared to the fence tracker (check ``declared``): the fence of an op that touches a
block it did not declare ignores that block's other lanes.

Owned by one executor; one per op; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

Tier = Literal["device", "host"]


class Touches:
    """See the module docstring."""

    __slots__ = ("reads", "writes")

    def __init__(self) -> None:
        self.reads: dict[Tier, set[int]] = {"device": set(), "host": set()}
        self.writes: dict[Tier, set[int]] = {"device": set(), "host": set()}

    def read(self, tier: Tier, blocks: Iterable[int]) -> None:
        self.reads[tier].update(blocks)

    def write(self, tier: Tier, blocks: Iterable[int]) -> None:
        self.writes[tier].update(blocks)

    def fields(self) -> dict[str, dict[str, list[int]]]:
        """``reads`` and ``writes`` as op.touched logs them (tiers without blocks left out)."""
        return {
            "reads": {tier: sorted(b) for tier, b in self.reads.items() if b},
            "writes": {tier: sorted(b) for tier, b in self.writes.items() if b},
        }

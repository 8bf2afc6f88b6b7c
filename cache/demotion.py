"""Demotion policies as data: what happens to a cached block when it leaves its tier.

The cache never moves bytes; it turns pool events into *intents*, which the engine
turns into numbered, fenced ops (swap lane for device <-> host, store lane for
host <-> storage). Two events matter, per tier boundary (device -> host, host ->
storage), and the policy of that boundary decides:

==============  =======================================  ===============================
policy          a block fills (gets its key)             a cached block is evicted
==============  =======================================  ===============================
write_back      nothing                                  copy it down, then reuse
write_through   copy it down now                         nothing: the copy exists
none            nothing                                  drop it: the key is forgotten
==============  =======================================  ===============================

A copy down is skipped when the lower tier already holds the key (keys name
content, so equal keys are equal bytes). Eviction is lazy (see block_pool.py): it
happens when an allocation reuses the block, so a write-back copy reads the block
just before it is overwritten; the fence rule orders the two (I2 and I3 of
docs/design.md, "Invariants I1-I4").
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Literal, NamedTuple, get_args

from ringfence.cache.ids import BlockHash, BlockId

Policy = Literal["write_back", "write_through", "none"]
POLICIES: tuple[Policy, ...] = get_args(Policy)
Boundary = Literal["device->host", "host->storage"]


class CopyDown(NamedTuple):
    """Copy block ``block_id`` of the upper tier, holding ``key``, to the tier below."""

    boundary: Boundary
    block_id: BlockId
    key: BlockHash
    reason: Literal["evicted", "filled"]


def _check(policy: str) -> Policy:
    if policy not in POLICIES:
        raise ValueError(f"demotion policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    return policy


def on_filled(
    policy: str,
    boundary: Boundary,
    filled: Iterable[tuple[BlockId, BlockHash]],
    lower_has: Callable[[BlockHash], bool],
) -> list[CopyDown]:
    """Intents for blocks that just became full and got their key. Mutates nothing."""
    if _check(policy) != "write_through":
        return []
    return [CopyDown(boundary, b, k, "filled") for b, k in filled if not lower_has(k)]


def on_evicted(
    policy: str,
    boundary: Boundary,
    evicted: Iterable[tuple[BlockId, BlockHash]],
    lower_has: Callable[[BlockHash], bool],
) -> list[CopyDown]:
    """Intents for cached blocks an allocation is about to reuse. Mutates nothing."""
    if _check(policy) != "write_back":
        return []
    return [CopyDown(boundary, b, k, "evicted") for b, k in evicted if not lower_has(k)]

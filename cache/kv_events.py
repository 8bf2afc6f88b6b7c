"""KV events: what the cache of one instance holds, as changes a router can follow.

docs/design.md, "KV events and routing". The scheduler's pools report every key they gain or
lose (:class:`~ringfence.cache.block_pool.BlockPool`'s ``on_key``), the block manager
reports the blocks storage holds once a write-back completed, and a device tier reset
(a Worker restart) clears the device tier at once. :class:`KVEventJournal` collects them
in order and hands them over once per scheduler round (:meth:`KVEventJournal.take`) as
three kinds of event, those of vLLM's KV events:

- :class:`BlockStored`: blocks became findable on a tier: their keys (a chain, each the
  parent of the next), the key of the first one's parent, their token ids, the block
  size and the tier's medium;
- :class:`BlockRemoved`: blocks left a tier (evicted, dropped as spoiled);
- :class:`AllBlocksCleared`: a tier was reset, or (``medium`` None) everything is
  unknown, as when an instance starts.

Media, named as vLLM names them where it has a name: the device tier ``GPU`` (whatever
the device: it is the tier a step computes on), the host tier ``CPU``, the storage tier
``STORAGE`` (no vLLM name exists). Storage is announced, never removed: a shared tier
evicts behind every instance's back, so a subscriber's storage entries are hints that may
cost a miss, never a wrong token.

A key is the scheduler's block key (``cache/block_hash.py``): 16 bytes, the chained hash
of the parent's key and the block's token ids, namespaced by the instance's fingerprint
(model, dtype, block size, KV layout, tp size). Equal prefixes on instances of the same
fingerprint have equal keys, which is what lets a router compare them.

Token ids come from :meth:`KVEventJournal.note`, called where keys are computed. The
lineage kept for it is bounded (``lineage`` entries, least recently used dropped first);
a key stored after its lineage fell out goes in an event of its own with no parent and no
tokens, and is counted in ``degraded``.

Pure bookkeeping: no I/O, no clock. Owned by one scheduler; not thread-safe.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Final, Literal

from ringfence.cache.ids import BlockHash

Tier = Literal["device", "host", "storage"]
MEDIA: Final[dict[str, str]] = {"device": "GPU", "host": "CPU", "storage": "STORAGE"}


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockStored:
    """Blocks ``keys`` (a chain: each key's parent is the key before it) became findable
    on ``medium``; ``parent`` is the first one's parent key (None: the first block of a
    sequence, or not known)."""

    keys: tuple[BlockHash, ...]
    parent: BlockHash | None
    token_ids: tuple[int, ...]  # block_size tokens a key, in key order; () when not known
    block_size: int
    medium: str


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockRemoved:
    """Blocks ``keys`` are no longer findable on ``medium``."""

    keys: tuple[BlockHash, ...]
    medium: str


@dataclass(frozen=True, slots=True, kw_only=True)
class AllBlocksCleared:
    """Every block of ``medium`` is gone (None: every tier is unknown from now on)."""

    medium: str | None = None


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class _Lineage:
    """A key's parent and token ids."""

    __slots__ = ("parent", "tokens")

    def __init__(self, parent: BlockHash | None, tokens: tuple[int, ...]) -> None:
        self.parent, self.tokens = parent, tokens


class KVEventJournal:
    """See the module docstring."""

    def __init__(self, block_size: int, *, lineage: int) -> None:
        if block_size <= 0 or lineage <= 0:
            raise ValueError(f"block_size and lineage must be > 0: got {block_size}, {lineage}")
        self.block_size = block_size
        self.capacity = lineage
        self._lineage: OrderedDict[BlockHash, _Lineage] = OrderedDict()
        self._events: list[KVEvent] = []
        self._muted: set[str] = set()  # tiers being cleared: their removals are in the clear
        self.degraded = 0  # keys stored with their lineage gone (no parent, no tokens)

    def note(self, key: BlockHash, parent: BlockHash | None, tokens: tuple[int, ...]) -> None:
        """Remember where ``key`` comes from: its parent key and its block's token ids."""
        if len(tokens) != self.block_size:
            raise ValueError(f"a block has {self.block_size} tokens, got {len(tokens)}")
        entry = self._lineage.get(key)
        if entry is None:
            self._lineage[key] = _Lineage(parent, tokens)
            if len(self._lineage) > self.capacity:
                self._lineage.popitem(last=False)
        else:
            self._lineage.move_to_end(key)

    def stored(self, tier: Tier, key: BlockHash) -> None:
        """``key`` became findable on ``tier``; joins the last event when it extends its chain."""
        medium = MEDIA[tier]
        entry = self._lineage.get(key)
        if entry is None:
            self.degraded += 1
            self._events.append(
                BlockStored(keys=(key,), parent=None, token_ids=(), block_size=self.block_size,
                            medium=medium)
            )  # fmt: skip
            return
        self._lineage.move_to_end(key)
        last = self._events[-1] if self._events else None
        if (
            isinstance(last, BlockStored)
            and last.medium == medium
            and last.token_ids
            and entry.parent == last.keys[-1]
        ):
            self._events[-1] = BlockStored(
                keys=(*last.keys, key),
                parent=last.parent,
                token_ids=(*last.token_ids, *entry.tokens),
                block_size=self.block_size,
                medium=medium,
            )
            return
        self._events.append(
            BlockStored(keys=(key,), parent=entry.parent, token_ids=entry.tokens,
                        block_size=self.block_size, medium=medium)
        )  # fmt: skip

    def removed(self, tier: Tier, key: BlockHash) -> None:
        """``key`` left ``tier``; joins the last event when it is a removal from that tier."""
        if tier in self._muted:
            return
        medium = MEDIA[tier]
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            self._events[-1] = BlockRemoved(keys=(*last.keys, key), medium=medium)
        else:
            self._events.append(BlockRemoved(keys=(key,), medium=medium))

    def clearing(self, tier: Tier | None) -> _Clearing:
        """A context in which ``tier`` (None: every tier) is cleared: one AllBlocksCleared,
        and the removals its pools report meanwhile are left out."""
        return _Clearing(self, tier)

    def take(self) -> list[KVEvent]:
        """The events since the last call, in order; clears them."""
        events, self._events = self._events, []
        return events


class _Clearing:
    def __init__(self, journal: KVEventJournal, tier: Tier | None) -> None:
        self.journal, self.tiers = journal, set(MEDIA) if tier is None else {tier}
        self.medium = None if tier is None else MEDIA[tier]

    def __enter__(self) -> None:
        self.journal._events.append(AllBlocksCleared(medium=self.medium))
        self.journal._muted |= self.tiers

    def __exit__(self, *exc: object) -> None:
        self.journal._muted -= self.tiers

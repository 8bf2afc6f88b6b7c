"""Which instances hold which blocks, on which tier: a router's index, fed by KV events.

docs/design.md, "KV events and routing". A router follows every instance's KV events
(``cache/kv_events.py``, received in vLLM's wire format) and keeps, per block key, a mask
of the (instance, medium) pairs that announced it. For a prompt's keys (hashed as the
engine hashes them), :meth:`KVIndex.overlap` tells each instance's longest cached prefix
and how many of its blocks sit on each medium, from which the router scores instances.

The index is a hint: an entry may be stale (an eviction the router has not heard of yet,
a storage tier that evicted behind everyone's back); a stale entry costs a miss and a
recomputation on the instance, never a wrong token, since the instance finds its own
blocks by their full keys.

Memory. Keys are stored as the first 8 bytes of the 16-byte block key (a truncation: two
keys that share them are one entry, which costs at most a miss), in an open-addressing
table of two flat ``array('Q')`` (key, mask) of a power of two slots, linear probing,
rebuilt (doubled when live entries need it) once live and deleted slots pass 5/8: 16
bytes a slot, so 26 to 43 bytes a cached block (:meth:`KVIndex.bytes_per_block` says
which), against about 110 for a dict of bytes to int. Up to 21 instances (3 media each in
a 64-bit mask).

Pure bookkeeping; not thread-safe: one owner (the router's event loop) calls it.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ringfence.cache.ids import BlockHash
from ringfence.cache.kv_events import MEDIA, BlockRemoved, BlockStored, KVEvent

MEDIA_ORDER = (MEDIA["device"], MEDIA["host"], MEDIA["storage"])  # GPU, CPU, STORAGE
MAX_INSTANCES = 64 // len(MEDIA_ORDER)
_EMPTY, _DELETED = 0, 1  # slot markers; a stored key is odd and at least 3
_FIRST_SLOTS = 1024
_MAX_LOAD = (5, 8)  # grow past 5/8 of the slots live or deleted


@dataclass(frozen=True, slots=True)
class Overlap:
    """An instance's longest cached prefix of a prompt's blocks: ``blocks`` in all, of
    which ``on[medium]`` are best found on each medium (device before host before storage)."""

    blocks: int
    on: dict[str, int] = field(default_factory=dict)


def _slot_key(key: BlockHash) -> int:
    k = int.from_bytes(key[:8], "big") | 1
    return 3 if k == 1 else k


class KVIndex:
    """See the module docstring."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._keys = array("Q", bytes(8 * _FIRST_SLOTS))
        self._masks = array("Q", bytes(8 * _FIRST_SLOTS))
        self._live = 0
        self._deleted = 0

    # Instances.

    def instance(self, name: str) -> int:
        """The index of instance ``name`` (added on first use; ValueError past the limit)."""
        if name in self._names:
            return self._names.index(name)
        if len(self._names) >= MAX_INSTANCES:
            raise ValueError(f"an index follows at most {MAX_INSTANCES} instances")
        self._names.append(name)
        return len(self._names) - 1

    @property
    def instances(self) -> tuple[str, ...]:
        return tuple(self._names)

    def _bits(self, name: str, medium: str | None) -> int:
        """The mask bits of ``name`` on ``medium`` (None: every medium)."""
        base = len(MEDIA_ORDER) * self.instance(name)
        if medium is None:
            return ((1 << len(MEDIA_ORDER)) - 1) << base
        return 1 << (base + _medium_index(medium))

    # Events.

    def apply(self, name: str, event: KVEvent) -> None:
        """One event of instance ``name``."""
        if isinstance(event, BlockStored):
            bit = self._bits(name, event.medium)
            for key in event.keys:
                self._set(_slot_key(key), bit)
        elif isinstance(event, BlockRemoved):
            bit = self._bits(name, event.medium)
            for key in event.keys:
                self._clear(_slot_key(key), bit)
        else:
            self.clear(name, event.medium)

    def apply_all(self, name: str, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(name, event)

    def clear(self, name: str, medium: str | None = None) -> None:
        """Forget what ``name`` holds on ``medium`` (None: everywhere): an AllBlocksCleared,
        an instance restarted or found dead. Time in the table's size."""
        keep = ~self._bits(name, medium) & 0xFFFF_FFFF_FFFF_FFFF
        keys, masks = self._keys, self._masks
        for slot in range(len(keys)):
            if keys[slot] > _DELETED and masks[slot]:
                mask = masks[slot] & keep
                masks[slot] = mask
                if not mask:
                    keys[slot] = _DELETED
                    self._live -= 1
                    self._deleted += 1

    # Questions.

    def overlap(self, keys: Sequence[BlockHash]) -> dict[str, Overlap]:
        """Each instance's longest cached prefix of ``keys`` (a prompt's block keys, in
        order), and where its blocks are best found (see :class:`Overlap`)."""
        found: dict[str, Overlap] = {}
        alive = (1 << (len(MEDIA_ORDER) * len(self._names))) - 1
        counts = [[0] * len(MEDIA_ORDER) for _ in self._names]
        length = [0] * len(self._names)
        width = len(MEDIA_ORDER)
        for position, key in enumerate(keys):
            mask = self._get(_slot_key(key)) & alive
            if not mask:
                break
            for i in range(len(self._names)):
                held = (mask >> (width * i)) & ((1 << width) - 1)
                if not held:
                    alive &= ~(((1 << width) - 1) << (width * i))  # its prefix ended
                    continue
                length[i] = position + 1
                counts[i][(held & -held).bit_length() - 1] += 1  # the best medium
            if not alive:
                break
        for i, name in enumerate(self._names):
            found[name] = Overlap(
                length[i], {m: counts[i][t] for t, m in enumerate(MEDIA_ORDER) if counts[i][t]}
            )
        return found

    def __len__(self) -> int:
        """Blocks held by at least one instance somewhere."""
        return self._live

    def bytes_per_block(self) -> float:
        """The table's bytes over the blocks it holds (inf when empty)."""
        size = self._keys.itemsize * len(self._keys) + self._masks.itemsize * len(self._masks)
        return size / self._live if self._live else float("inf")

    # The table.

    def _find(self, k: int) -> int:
        """The slot of ``k``, or the slot to put it in (the first deleted one on its path)."""
        keys = self._keys
        n = len(keys)
        slot = k & (n - 1)  # a power of two; k is a hash's bits already
        free = -1
        while True:
            here = keys[slot]
            if here == k:
                return slot
            if here == _EMPTY:
                return slot if free < 0 else free
            if here == _DELETED and free < 0:
                free = slot
            slot = slot + 1 if slot + 1 < n else 0

    def _get(self, k: int) -> int:
        slot = self._find(k)
        return self._masks[slot] if self._keys[slot] == k else 0

    def _set(self, k: int, bit: int) -> None:
        slot = self._find(k)
        if self._keys[slot] == k:
            self._masks[slot] |= bit
            return
        if self._keys[slot] == _DELETED:
            self._deleted -= 1
        self._keys[slot], self._masks[slot] = k, bit
        self._live += 1
        if (self._live + self._deleted) * _MAX_LOAD[1] > len(self._keys) * _MAX_LOAD[0]:
            self._rebuild()

    def _clear(self, k: int, bit: int) -> None:
        slot = self._find(k)
        if self._keys[slot] != k:
            return
        mask = self._masks[slot] & ~bit
        self._masks[slot] = mask
        if not mask:
            self._keys[slot] = _DELETED
            self._live -= 1
            self._deleted += 1

    def _rebuild(self) -> None:
        """The live entries only, in a table (never smaller) where they fill at most 3/8:
        doubled when the table filled up with live ones, the same size when deleted slots
        made up the load."""
        old = [(k, m) for k, m in zip(self._keys, self._masks, strict=True) if k > _DELETED]
        size = len(self._keys)
        while len(old) * 8 > size * 3:
            size *= 2
        self._keys = array("Q", bytes(8 * size))
        self._masks = array("Q", bytes(8 * size))
        self._live = self._deleted = 0
        for k, m in old:
            slot = self._find(k)
            self._keys[slot], self._masks[slot] = k, m
            self._live += 1


def _medium_index(medium: str) -> int:
    try:
        return MEDIA_ORDER.index(medium)
    except ValueError:
        raise ValueError(
            f"medium {medium!r} is none of {', '.join(MEDIA_ORDER)}: an event this index "
            "cannot place"
        ) from None

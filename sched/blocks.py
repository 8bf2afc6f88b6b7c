"""The scheduler's block bookkeeping: the pools of both tiers, demotion, and fenced op issue.

:class:`BlockManager` owns the device and host :class:`BlockPool`, the
:class:`PrefixIndex` over them and storage, and the :class:`Issuer` (:mod:`sched.issue`,
with the :class:`FenceTracker`). Every op it issues gets its number and fence at once, in
the order of the calls, and is appended to the outgoing list that the issuer's
``take_ops`` hands to the engine. Issuing in call order is what makes the orders right
without further care: the write-back of
an evicted host block is issued by the allocation that reuses it, so before the
swap-out that overwrites it; the swap-out of an evicted device block before the
swap-in or step that overwrites it; a write-through before nothing that could
overwrite its source, since the source is in use.

Demotion (docs/design.md, "Blocks and tiers", ``ringfence.cache.demotion``): a device block
leaves to the host tier when there is one, else to storage through the staging
blocks of the host tensor; a host block leaves to storage. ``stored`` remembers the
keys this instance has sent to storage, so it never writes one twice, and counts
them as present in the prefix index at once: the store lane is one FIFO, so a
prefetch issued after a write-back finds the write done. With several ranks each
rank's store lane is its own FIFO and every op goes to each, so the same holds at
every rank; the engine applies a write-back's completion once every rank reported
it, failed if any rank's failed, and a failed one takes its keys out of ``stored``.

Owned by one scheduler; not thread-safe; no I/O except the storage presence object
the caller passes in (the engine's storage client, or a fake in tests).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import nullcontext

from ringfence.cache.block_pool import BlockPool
from ringfence.cache.demotion import on_evicted, on_filled
from ringfence.cache.fences import FenceTracker, Lane
from ringfence.cache.ids import BlockHash, BlockId
from ringfence.cache.kv_events import KVEventJournal, Tier
from ringfence.cache.prefix_index import PrefixIndex, PrefixMatch, StoragePresence
from ringfence.sched.config import TierConfig
from ringfence.sched.issue import Issuer
from ringfence.sched.ops import Piece, Reason, StepOp, StoreOp, SwapOp
from ringfence.sched.stored import StoredSet


def _told(events: KVEventJournal | None, tier: Tier) -> Callable[[BlockHash, bool], None] | None:
    """A pool's ``on_key`` that tells ``events`` of the keys ``tier`` gains and loses."""
    if events is None:
        return None
    journal = events

    def on_key(key: BlockHash, cached: bool) -> None:
        if cached:
            journal.stored(tier, key)
        else:
            journal.removed(tier, key)

    return on_key


class BlockManager:
    """See the module docstring.

    The scheduler drives it through its methods only; of its attributes, the scheduler
    takes the ops from ``issuer``, the engine reads the issuer's ``inflight`` and ``moved``,
    and tests may inspect the pools ``device`` and
    ``host`` (read only: a block taken or keyed behind the manager's back breaks the
    references the scheduler counts on).
    """

    def __init__(
        self,
        config: TierConfig,
        storage: StoragePresence | None = None,
        first_numbers: Mapping[Lane, int] | None = None,
        *,
        keep_access: bool = False,
        events: KVEventJournal | None = None,
    ) -> None:
        """``keep_access``: the tracker keeps each op's declared sets (see
        :meth:`FenceTracker.take_access`), for the engine's trace. ``events``: told every
        key a tier gains or loses (KV events; storage once a write-back completed ok)."""
        self.config = config
        self.events = events
        self.device = BlockPool(config.device_blocks, name="device", on_key=_told(events, "device"))
        self.host = BlockPool(config.host_blocks, name="host", on_key=_told(events, "host"))
        self.stored = StoredSet(storage if config.storage else None)
        self.index = PrefixIndex(
            self.device,
            self.host if config.host_cache else None,
            self.stored if config.storage else None,
        )
        tracker = FenceTracker(config.device_blocks, config.host_blocks, keep_access=keep_access)
        self.issuer = Issuer(config.block_size, tracker, first_numbers)
        self._poison: list[BlockId] = []  # freed unkeyed device blocks, for the next step

    # The ops (numbered, fenced and listed by the issuer).

    def issue_step(self, pieces: Sequence[Piece], closed: tuple[int, ...] = ()) -> StepOp:
        """The step running ``pieces`` (and the poison of blocks freed since the last one),
        telling the Worker to forget the ``closed`` sequences."""
        poison: tuple[int, ...] = ()
        if self.config.poison_freed and self._poison:
            # A block freed and handed out again since is written by its new owner: skip it.
            free = [b for b in dict.fromkeys(self._poison) if self.device.ref_count(b) == 0]
            poison = tuple(b for b in free if self.device.key_of(b) is None)
        self._poison.clear()
        return self.issuer.step(pieces, closed, poison)

    def _write(self, host: Sequence[BlockId], keys: Sequence[BlockHash], reason: Reason) -> None:
        """Write host blocks to storage; their keys count as stored from now on (the store
        lane is one FIFO: a prefetch issued later finds the write done)."""
        self.issuer.store("write", host, keys, reason)
        self.stored.keys.update(keys)

    # Allocation and demotion.

    def allocate_device(self, count: int) -> list[BlockId] | None:
        """``count`` device blocks with one reference each, or None (nothing taken).

        Cached blocks the allocation reuses are demoted first, by the device policy.
        """
        allocation = self.device.try_allocate(count)
        if allocation is None:
            return None
        if allocation.evicted:
            copies = on_evicted(
                self.config.device_eviction, "device->host", allocation.evicted, self._lower_has
            )
            self.copy_down([c.block_id for c in copies], [c.key for c in copies], "evict")
        return list(allocation.block_ids)

    def allocate_host(self, count: int) -> list[BlockId] | None:
        """``count`` host blocks, or None; evicted cached ones are written back by policy."""
        allocation = self.host.try_allocate(count)
        if allocation is None:
            return None
        if allocation.evicted and self.config.storage:
            copies = on_evicted(
                self.config.host_eviction, "host->storage", allocation.evicted, self.stored.has
            )
            if copies:
                self._write([c.block_id for c in copies], [c.key for c in copies], "evict")
        return list(allocation.block_ids)

    def _lower_has(self, key: BlockHash) -> bool:
        if self.config.host_cache:
            return self.host.find(key) is not None
        return not self.config.storage or self.stored.has(key)

    def copy_down(
        self, blocks: Sequence[BlockId], keys: Sequence[BlockHash], reason: Reason
    ) -> bool:
        """Copy full device blocks holding ``keys`` to the tier below; False if there was no room.

        To the host tier (the copies are cached there under their keys), or with no
        host tier, through staging blocks to storage.
        """
        if not blocks:
            return True
        if self.config.host_cache:
            host = self.allocate_host(len(blocks))
            if host is None:
                return False
            self.issuer.swap("out", blocks, host, reason)
            for b, key in zip(host, keys, strict=True):
                self.host.set_key(b, key)
            self.host.free(reversed(host))  # cached and findable, free for reuse
            if self.config.host_eviction == "write_through" and self.config.storage:
                self.write_back(host, keys, "through")
            return True
        if self.config.storage:
            return self.save(blocks, keys, reason)
        return True

    def save(self, blocks: Sequence[BlockId], keys: Sequence[BlockHash], reason: Reason) -> bool:
        """Write full device blocks to storage through staging host blocks (freed at issue)."""
        pairs = [(b, k) for b, k in zip(blocks, keys, strict=True) if not self.stored.has(k)]
        if not pairs:
            return True
        staging = self.host.try_allocate(len(pairs))
        if staging is None:
            return False
        # Staging blocks hold no keys here (host_cache off, or taken from the free list with
        # their keys evicted): write those keys back first if the policy asks for it.
        if staging.evicted and self.config.storage:
            copies = on_evicted(
                self.config.host_eviction, "host->storage", staging.evicted, self.stored.has
            )
            if copies:
                self._write([c.block_id for c in copies], [c.key for c in copies], "evict")
        host = list(staging.block_ids)
        self.issuer.swap("out", [b for b, _ in pairs], host, reason)
        self._write(host, [k for _, k in pairs], reason)
        self.host.free(host)  # free at issue: a later writer of these blocks waits (I4)
        return True

    def save_all(self, blocks: Sequence[BlockId], keys: Sequence[BlockHash], reason: Reason) -> int:
        """:meth:`save` in rounds of as many blocks as the host pool has free (each round's
        staging blocks are free again at issue, so the next round may take them: its
        swap-out waits for the write that reads them, I4). Returns how many leading blocks
        are stored or being stored: all, unless the host pool has no free block at all."""
        done = 0
        while done < len(blocks):
            chunk = min(len(blocks) - done, self.host.num_free)
            if chunk == 0 or not self.save(
                blocks[done : done + chunk], keys[done : done + chunk], reason
            ):
                break
            done += chunk
        return done

    def write_back(
        self, host: Sequence[BlockId], keys: Sequence[BlockHash], reason: Reason
    ) -> None:
        pairs = [(b, k) for b, k in zip(host, keys, strict=True) if not self.stored.has(k)]
        if pairs:
            self._write([b for b, _ in pairs], [k for _, k in pairs], reason)

    def filled(self, blocks: Sequence[BlockId], keys: Sequence[BlockHash]) -> None:
        """Device blocks that just became full of computed KV: key them (and copy down by policy).

        A block whose key another block already holds stays unkeyed (a duplicate).
        """
        keyed: list[tuple[BlockId, BlockHash]] = []
        for b, key in zip(blocks, keys, strict=True):
            if self.device.set_key(b, key) == b:
                keyed.append((b, key))
        copies = on_filled(self.config.device_eviction, "device->host", keyed, self._lower_has)
        if copies:
            self.copy_down([c.block_id for c in copies], [c.key for c in copies], "through")

    def swap_in(self, host: Sequence[BlockId], device: Sequence[BlockId], reason: Reason) -> None:
        if host:
            self.issuer.swap("in", device, host, reason)

    def swap_out(self, device: Sequence[BlockId], host: Sequence[BlockId], reason: Reason) -> None:
        if device:
            self.issuer.swap("out", device, host, reason)

    def prefetch(self, host: Sequence[BlockId], keys: Sequence[BlockHash]) -> StoreOp:
        return self.issuer.store("read", host, keys, "admit")

    def free_device(self, blocks: Sequence[BlockId]) -> None:
        """Drop a reference to each block, last block first (the prefix stays cached longest)."""
        self.device.free(reversed(blocks))
        if self.config.poison_freed:
            self._poison.extend(b for b in blocks if self.device.ref_count(b) == 0)

    # The host blocks the scheduler holds: swap-out copies, prefetched blocks, host hits.

    def release_host(self, blocks: Iterable[BlockId]) -> None:
        """Drop one reference to each host block, in order; a block left with none joins
        the free queue's tail, in that order (the first is reused first).

        Free at issue: the blocks may be reallocated at once, because the op that writes
        one next is fenced after every op already issued on it (I4). Mutates the host
        pool's reference counts and free queue; keys stay (a cached block stays findable).
        """
        self.host.free(blocks)

    def release_host_hits(self, match: PrefixMatch) -> None:
        """Drop the references :meth:`acquire` took on the host hits of ``match``, in match
        order, once their swap-in is issued (free at issue, as :meth:`release_host`).

        The device hits keep theirs: they are the admitted sequence's blocks now.
        Mutates the host pool as :meth:`release_host`.
        """
        self.release_host(
            [
                b
                for w, b in zip(match.where, match.block_ids, strict=True)
                if w == "host" and b is not None
            ]
        )

    def hold_on_host(self, blocks: Sequence[BlockId], keys: Sequence[BlockHash]) -> list[BlockId]:
        """Key host blocks the caller holds (one reference each) under ``keys``, so that
        admissions find them; returns the blocks the caller holds after, in order.

        For the full blocks of a swap-out or a finished prefetch: their contents are, or
        once the op that fills them completes will be, the blocks of ``keys``. A block
        whose key another host block holds already is a duplicate: the caller holds that
        block instead (one reference taken) and the duplicate is handed back (its
        reference dropped; it stays unkeyed). Mutates the host pool's keys, reference
        counts and free queue; the duplicates join the free queue's tail in order, after
        every reference is taken.
        """
        held: list[BlockId] = []
        duplicates: list[BlockId] = []
        for b, key in zip(blocks, keys, strict=True):
            holder = self.host.set_key(b, key)
            if holder != b:  # the host tier has it already: hold that copy instead
                self.host.take(holder)
                duplicates.append(b)
            held.append(holder)
        self.host.free(duplicates)
        return held

    def forget_copies(self, device: Sequence[BlockId], keys: Iterable[BlockHash]) -> None:
        """Make every cached copy of a sequence's blocks unfindable, on both tiers: the keys
        of its device blocks ``device``, then each of ``keys`` wherever a device or host
        block holds it (a copy made of a block, by write-through or swap-out, carries what
        the block held; a failed step spoiled its blocks, so their copies too).

        Mutates the keys of both pools only: reference counts and free queues stay.
        """
        self.forget(device=device)
        for key in keys:
            for pool in (self.device, self.host):
                block = pool.find(key)
                if block is not None:
                    pool.drop_key(block)

    def match(self, keys: Sequence[BlockHash], storage_until: int | None = None) -> PrefixMatch:
        """The longest cached prefix of ``keys``; storage hits only before ``storage_until``.

        A block the index finds only in storage but that a finished prefetch left keyed
        in the host pool counts as a host hit, also when the host blocks are only
        staging (no host cache tier): that is how a prefetch's blocks are swapped in.
        """
        found = self.index.match(keys)
        where, ids = list(found.where), list(found.block_ids)
        for i, tier in enumerate(where):
            if tier == "storage" and (block := self.host.find(found.keys[i])) is not None:
                where[i], ids[i] = "host", block
        end = len(where)
        if storage_until is not None and "storage" in where[storage_until:]:
            end = storage_until + where[storage_until:].index("storage")
        return PrefixMatch(found.keys[:end], tuple(where[:end]), tuple(ids[:end]))

    def acquire(self, match: PrefixMatch) -> None:
        """Take a reference on every device and host block of a fresh ``match``."""
        for tier, block in zip(match.where, match.block_ids, strict=True):
            if block is not None:
                (self.device if tier == "device" else self.host).take(block)

    def release(self, match: PrefixMatch) -> None:
        """Drop the references :meth:`acquire` took."""
        for tier, block in zip(match.where, match.block_ids, strict=True):
            if block is not None:
                (self.device if tier == "device" else self.host).free([block])

    def completed(self, lane: Lane, number: int, status: str) -> SwapOp | StoreOp | None:
        """Record a transfer op's completion; the op, or None if it was not in flight.

        An op that did not finish ok leaves nothing usable where it wrote: a swap-out's
        host copies and a swap-in's device blocks lose their keys, a write-back's keys are
        no longer taken as stored unless a later write of them is in flight (a prefetch's
        are the scheduler's to handle).
        """
        op = self.issuer.completed(lane, number)
        if op is None:
            return op
        if status == "ok":
            if self.events is not None and isinstance(op, StoreOp) and op.direction == "write":
                for key in op.keys:  # whole and visible in storage from now on
                    self.events.stored("storage", key)
            return op
        if isinstance(op, SwapOp):
            if op.direction == "out":
                self.forget(host=[BlockId(b) for b in op.host_blocks])
            else:
                self.forget(device=[BlockId(b) for b in op.device_blocks])
        elif op.direction == "write":
            # A later write of the same key, still in flight, may yet store it.
            writing = {
                key
                for other in self.issuer.inflight.values()
                if isinstance(other, StoreOp) and other.direction == "write"
                for key in other.keys
            }
            self.stored.keys.difference_update(set(op.keys) - writing)
        return op

    def reset_device(self) -> None:
        """Forget every device block's key: the tier was reset. Every block must be free."""
        used = self.device.num_used
        if used:
            raise RuntimeError(f"device tier reset with {used} blocks still in use")
        with self.events.clearing("device") if self.events is not None else nullcontext():
            for b in range(self.device.num_blocks):
                self.device.drop_key(BlockId(b))
        self._poison.clear()  # a new Worker starts with every block poisoned when asked

    def forget(self, device: Sequence[BlockId] = (), host: Sequence[BlockId] = ()) -> None:
        """Make blocks unfindable: what they hold is not what their keys say (a failed op)."""
        for b in device:
            self.device.drop_key(b)
        for b in host:
            self.host.drop_key(b)

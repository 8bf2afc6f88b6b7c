"""The prefix index: the longest cached prefix of a key chain, across device, host and storage.

A request's full blocks have chained keys (block_hash.py), so a key names the
whole prefix up to its block, and a prefix is cached as far as each of its blocks
is held by *some* tier. The device and host pools answer from their key maps;
storage is asked once per match, for the blocks neither pool holds, through the
backend's ``longest_prefix`` (which reports how many leading keys of a list are
present). Each matched block is reported in the fastest tier that holds it.

:meth:`PrefixIndex.match` mutates nothing, and its result is valid only until the
next change to a pool: a free cached block it names may be reused by the next
allocation. :meth:`PrefixIndex.acquire` takes a reference on each device and host
block of a match, after which those blocks stay put until the caller frees them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, NamedTuple, Protocol

from ringfence.cache.block_pool import BlockPool
from ringfence.cache.ids import BlockHash, BlockId

Where = Literal["device", "host", "storage"]


class StoragePresence(Protocol):
    """What the index needs of a storage backend (ringfence.cache.storage has it)."""

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int: ...


class PrefixMatch(NamedTuple):
    """The cached prefix of a key chain: one entry per matched block, in chain order."""

    keys: tuple[BlockHash, ...]  # the matched keys: a prefix of the chain asked about
    where: tuple[Where, ...]  # per block, the fastest tier holding it
    block_ids: tuple[BlockId | None, ...]  # per block, its id in that tier's pool (storage: None)

    def count(self, tier: Where) -> int:
        """How many matched blocks the fastest copy of which is in ``tier``."""
        return self.where.count(tier)


NO_MATCH = PrefixMatch((), (), ())


class PrefixIndex:
    """Reads the pools' key maps and asks storage. Owned by the engine; not thread-safe."""

    def __init__(
        self,
        device: BlockPool,
        host: BlockPool | None = None,
        storage: StoragePresence | None = None,
    ) -> None:
        self.device = device
        self.host = host
        self.storage = storage

    def match(self, keys: Sequence[BlockHash]) -> PrefixMatch:
        """The longest prefix of ``keys`` that some tier holds. Mutates nothing.

        O(len(keys)) dictionary lookups, plus one storage query for the keys that
        neither pool holds (only when there is a storage tier).
        """
        device_find = self.device.find
        host_find = self.host.find if self.host is not None else None
        where: list[Where] = []
        ids: list[BlockId | None] = []
        elsewhere: list[int] = []  # positions held by neither pool: storage must have them
        for position, key in enumerate(keys):
            block = device_find(key)
            if block is not None:
                where.append("device")
                ids.append(block)
                continue
            if host_find is not None and (block := host_find(key)) is not None:
                where.append("host")
                ids.append(block)
                continue
            if self.storage is None:
                break
            where.append("storage")
            ids.append(None)
            elsewhere.append(position)
        end = len(where)
        if elsewhere:
            assert self.storage is not None
            present = self.storage.longest_prefix([keys[p] for p in elsewhere])
            if present < len(elsewhere):
                end = elsewhere[present]  # the first block no tier holds ends the prefix
        if end == 0:
            return NO_MATCH
        return PrefixMatch(tuple(keys[:end]), tuple(where[:end]), tuple(ids[:end]))

    def acquire(self, match: PrefixMatch) -> None:
        """Take one reference on every device and host block of ``match`` (free ones leave
        the free queue). Call it before the pools change; release with the pools' ``free``.
        Raises ValueError, having taken nothing, if the match is stale.
        """
        pools = {"device": self.device, "host": self.host}
        for key, tier, block in zip(match.keys, match.where, match.block_ids, strict=True):
            pool = pools.get(tier)
            if pool is not None and (block is None or pool.find(key) != block):
                raise ValueError(
                    f"stale prefix match: {tier} block {block} no longer holds its key"
                )
        for tier, block in zip(match.where, match.block_ids, strict=True):
            pool = pools.get(tier)
            if pool is not None and block is not None:
                pool.take(block)

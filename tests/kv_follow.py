"""A follower of KV events for the tests: what it believes each medium holds."""

from __future__ import annotations

from ringfence.cache.block_hash import block_key
from ringfence.cache.ids import BlockHash
from ringfence.cache.kv_events import MEDIA, AllBlocksCleared, BlockRemoved, KVEvent


def follow(events: list[KVEvent], block_size: int, namespace: bytes) -> dict[str, set[BlockHash]]:
    """What a follower of ``events`` believes each medium holds; checks each event's keys
    against its tokens (the chain hashes again) and that nothing is removed unheld."""
    held: dict[str, set[BlockHash]] = {m: set() for m in MEDIA.values()}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            for medium in [event.medium] if event.medium else list(held):
                held[medium].clear()
        elif isinstance(event, BlockRemoved):
            assert set(event.keys) <= held[event.medium], event
            held[event.medium] -= set(event.keys)
        else:
            if event.token_ids:
                parent = event.parent
                for i, k in enumerate(event.keys):
                    tokens = event.token_ids[i * block_size : (i + 1) * block_size]
                    assert block_key(parent, tokens, namespace=namespace) == k, event
                    parent = k
            held[event.medium] |= set(event.keys)
    return held

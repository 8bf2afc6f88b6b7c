"""KV event batches in vLLM's wire format (msgpack), both layouts vLLM has used.

A batch is vLLM's ``KVEventBatch``: a timestamp, the events, and the data-parallel rank
(always 0: an instance is one engine). Each event is a tagged msgspec struct whose tag is
its class name. Two layouts, as ``events.layout`` chooses:

- ``map`` (vLLM's current one): the batch ``{"ts", "events", "data_parallel_rank"}``;
  each event ``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash",
  "token_ids", "block_size", "lora_id", "medium", "lora_name"}``, ``{"type":
  "BlockRemoved", "block_hashes", "medium"}`` or ``{"type": "AllBlocksCleared"}``;
- ``array`` (vLLM's ``array_like`` structs, before): the batch ``[ts, events, rank]``;
  each event ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]`` or
  ``["AllBlocksCleared"]``.

Block hashes are ringfence's 16-byte keys as msgpack bin (vLLM's ``ExternalBlockHash``
is bytes or int). One addition vLLM's classes ignore when they decode (unknown map keys
and trailing array items are skipped): an ``AllBlocksCleared`` of one tier carries its
``medium``; without it, every tier is cleared. :func:`decode_batch` reads either layout
back into ``cache/kv_events.py``'s events, for ringfence's own subscribers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, Literal, NamedTuple

import msgpack

from ringfence.cache.ids import BlockHash
from ringfence.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

Layout = Literal["map", "array"]
LAYOUTS: Final = ("map", "array")


class EventBatch(NamedTuple):
    """A decoded batch: when it was published, its events, and the publisher's rank."""

    ts: float
    events: list[KVEvent]
    rank: int | None


def encode_batch(ts: float, events: Sequence[KVEvent], *, layout: Layout) -> bytes:
    """One batch as vLLM's publisher writes it (see the module docstring)."""
    if layout == "map":
        body: Any = {"ts": ts, "events": [_as_map(e) for e in events], "data_parallel_rank": 0}
    elif layout == "array":
        body = [ts, [_as_array(e) for e in events], 0]
    else:
        raise ValueError(f"events.layout must be one of {', '.join(LAYOUTS)}: got {layout!r}")
    return bytes(msgpack.packb(body, use_bin_type=True))


def _as_map(event: KVEvent) -> dict[str, Any]:
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.keys),
            "parent_block_hash": event.parent,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": event.medium,
            "lora_name": None,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.keys), "medium": event.medium}
    if event.medium is None:
        return {"type": "AllBlocksCleared"}
    return {"type": "AllBlocksCleared", "medium": event.medium}


def _as_array(event: KVEvent) -> list[Any]:
    if isinstance(event, BlockStored):
        return [
            "BlockStored",
            list(event.keys),
            event.parent,
            list(event.token_ids),
            event.block_size,
            None,
            event.medium,
        ]
    if isinstance(event, BlockRemoved):
        return ["BlockRemoved", list(event.keys), event.medium]
    return ["AllBlocksCleared"] if event.medium is None else ["AllBlocksCleared", event.medium]


class WireError(ValueError):
    """A payload that is not a KV event batch in either layout; says what was wrong."""


def decode_batch(payload: bytes) -> EventBatch:
    """A batch of either layout (WireError naming the fault otherwise)."""
    try:
        body = msgpack.unpackb(payload, raw=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise WireError(f"not msgpack: {e}") from None
    if isinstance(body, dict):
        ts, events, rank = body.get("ts"), body.get("events"), body.get("data_parallel_rank")
    elif isinstance(body, list) and len(body) >= 2:
        ts, events, rank = body[0], body[1], body[2] if len(body) > 2 else None
    else:
        raise WireError(f"a batch is a map or an array of [ts, events, rank]: got {body!r:.80}")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise WireError(f"a batch needs a number ts and a list of events: got {body!r:.80}")
    return EventBatch(
        float(ts), [_event(e) for e in events], rank if isinstance(rank, int) else None
    )


def _event(item: Any) -> KVEvent:
    if isinstance(item, dict):
        kind, fields = item.get("type"), item
        get = fields.get
        if kind == "BlockStored":
            return _stored(get("block_hashes"), get("parent_block_hash"), get("token_ids"),
                           get("block_size"), get("medium"))  # fmt: skip
        if kind == "BlockRemoved":
            return BlockRemoved(keys=_keys(get("block_hashes")), medium=_medium(get("medium")))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared(medium=get("medium"))
    elif isinstance(item, list) and item:
        kind = item[0]
        if kind == "BlockStored" and len(item) >= 7:
            return _stored(item[1], item[2], item[3], item[4], item[6])
        if kind == "BlockRemoved" and len(item) >= 3:
            return BlockRemoved(keys=_keys(item[1]), medium=_medium(item[2]))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared(medium=item[1] if len(item) > 1 else None)
    raise WireError(f"not a KV event (BlockStored, BlockRemoved, AllBlocksCleared): {item!r:.80}")


def _stored(keys: Any, parent: Any, tokens: Any, block_size: Any, medium: Any) -> BlockStored:
    if not isinstance(block_size, int) or block_size <= 0:
        raise WireError(f"BlockStored's block_size must be a positive int: got {block_size!r}")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise WireError("BlockStored's token_ids must be a list of ints")
    if parent is not None and not isinstance(parent, bytes | int):
        raise WireError(f"BlockStored's parent_block_hash must be bytes or int: got {parent!r}")
    return BlockStored(
        keys=_keys(keys),
        parent=_hash(parent) if parent is not None else None,
        token_ids=tuple(tokens),
        block_size=block_size,
        medium=_medium(medium),
    )


def _keys(keys: Any) -> tuple[BlockHash, ...]:
    if not isinstance(keys, list):
        raise WireError(f"block_hashes must be a list: got {keys!r:.80}")
    return tuple(_hash(k) for k in keys)


def _hash(key: Any) -> BlockHash:
    """A block hash as bytes: ringfence's own are; vLLM's may be ints (8 bytes, big-endian)."""
    if isinstance(key, bytes):
        return BlockHash(key)
    if isinstance(key, int):
        return BlockHash(key.to_bytes(8, "big", signed=key < 0))
    raise WireError(f"a block hash is bytes or an int: got {key!r:.40}")


def _medium(medium: Any) -> str:
    """vLLM's events of before media name none: those are the GPU's."""
    if medium is None:
        return "GPU"
    if not isinstance(medium, str):
        raise WireError(f"medium must be a string: got {medium!r:.40}")
    return medium

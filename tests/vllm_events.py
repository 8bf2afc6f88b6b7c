"""vLLM's KV event classes, written as vLLM declares them (msgspec structs), in both
layouts vLLM has used: tagged maps (``Map*``, its current ``vllm/distributed/kv_events.py``)
and positional arrays (``Array*``, ``array_like=True``, before). A subscriber written to
either reads ringfence's events unchanged: that is what the tests check with these."""

from __future__ import annotations

from typing import Any

import msgspec


class MapEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class MapKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class MapBlockStored(MapKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class MapBlockRemoved(MapKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class MapAllBlocksCleared(MapKVCacheEvent, tag="AllBlocksCleared"):
    pass


class MapKVEventBatch(MapEventBatch):
    events: list[MapBlockStored | MapBlockRemoved | MapAllBlocksCleared]


class ArrayEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


class ArrayKVEventBatch(ArrayEventBatch):
    events: list[ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared]


DECODERS: dict[str, Any] = {
    "map": msgspec.msgpack.Decoder(type=MapKVEventBatch),
    "array": msgspec.msgpack.Decoder(type=ArrayKVEventBatch),
}

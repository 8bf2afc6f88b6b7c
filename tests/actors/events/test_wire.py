"""KV events on the wire (actors/events/wire.py): read by vLLM's own event classes in the
layout each was written for, and back by ringfence's decoder; malformed payloads named."""

from __future__ import annotations

import re

import msgpack
import pytest
from vllm_events import DECODERS

from ringfence.actors.events.wire import LAYOUTS, WireError, decode_batch, encode_batch
from ringfence.cache.ids import BlockHash
from ringfence.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


def key(n: int) -> BlockHash:
    return BlockHash(bytes([n]) * 16)


EVENTS: list[KVEvent] = [
    AllBlocksCleared(medium=None),
    BlockStored(keys=(key(1), key(2)), parent=None, token_ids=(5, 6, 7, 8), block_size=2,
                medium="GPU"),
    BlockStored(keys=(key(3),), parent=key(2), token_ids=(9, 10), block_size=2, medium="CPU"),
    BlockRemoved(keys=(key(1),), medium="GPU"),
    AllBlocksCleared(medium="GPU"),
]  # fmt: skip


@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllms_own_classes_read_every_event_in_their_layout(layout):
    batch = DECODERS[layout].decode(encode_batch(12.5, EVENTS, layout=layout))
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    names = [type(e).__name__.removeprefix(layout.capitalize()) for e in batch.events]
    assert names == ["AllBlocksCleared", "BlockStored", "BlockStored", "BlockRemoved",
                     "AllBlocksCleared"]  # fmt: skip
    stored = batch.events[1]
    assert stored.block_hashes == [key(1), key(2)] and stored.parent_block_hash is None
    assert stored.token_ids == [5, 6, 7, 8] and stored.block_size == 2
    assert stored.medium == "GPU" and stored.lora_id is None
    assert batch.events[2].parent_block_hash == key(2) and batch.events[2].medium == "CPU"
    assert batch.events[3].block_hashes == [key(1)] and batch.events[3].medium == "GPU"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ringfences_decoder_reads_back_either_layout(layout):
    batch = decode_batch(encode_batch(3.0, EVENTS, layout=layout))
    assert batch.ts == 3.0 and batch.rank == 0 and batch.events == EVENTS


def test_vllms_int_hashes_and_events_without_a_medium_are_read_as_the_gpus():
    payload = msgpack.packb(
        [1.0, [["BlockStored", [7, -2], None, [1, 2, 3, 4], 2, None, None],
               ["BlockRemoved", [7], None]]],
        use_bin_type=True,
    )  # fmt: skip
    batch = decode_batch(payload)
    assert batch.events[0] == BlockStored(
        keys=(BlockHash((7).to_bytes(8, "big")), BlockHash((-2).to_bytes(8, "big", signed=True))),
        parent=None, token_ids=(1, 2, 3, 4), block_size=2, medium="GPU",
    )  # fmt: skip
    assert batch.events[1] == BlockRemoved(keys=(BlockHash((7).to_bytes(8, "big")),), medium="GPU")


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb("hello"), "a batch is a map or an array"),
        (msgpack.packb({"ts": "x", "events": []}), "a number ts and a list of events"),
        (msgpack.packb([1.0, [["BlockMoved", []]]]), "not a KV event"),
        (msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": 5}]]), "must be a list"),
        (msgpack.packb([1.0, [["BlockStored", [], None, [1], 0, None, "GPU"]]]), "block_size"),
        (msgpack.packb([1.0, [["BlockStored", [], None, ["a"], 2, None, "GPU"]]]), "token_ids"),
    ],
)
def test_a_payload_that_is_not_a_batch_is_refused_naming_what_is_wrong(body, says):
    with pytest.raises(WireError, match=says):
        decode_batch(body)


def test_an_unknown_layout_is_refused_by_name():
    with pytest.raises(ValueError, match=re.escape("one of map, array: got 'json'")):
        encode_batch(0.0, [], layout="json")  # type: ignore[arg-type]

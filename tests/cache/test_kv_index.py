"""A router's index of KV events (cache/kv_index.py): which instance holds a prompt's
longest prefix and on which media, against a plain follower of the same events; clears,
limits and memory."""

from __future__ import annotations

import random

import pytest
from kv_follow import follow
from modelcheck.tables import driven

from ringfence.cache.ids import BlockHash
from ringfence.cache.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventJournal
from ringfence.cache.kv_index import MAX_INSTANCES, KVIndex, Overlap


def key(n: int) -> BlockHash:
    """Distinct in the first 8 bytes, which are what the index keeps."""
    return BlockHash((2 * n + 5).to_bytes(8, "big") + bytes(8))


def stored(keys: list[int], medium: str) -> BlockStored:
    return BlockStored(keys=tuple(key(n) for n in keys), parent=None, token_ids=(),
                       block_size=4, medium=medium)  # fmt: skip


def test_each_instance_gets_its_longest_prefix_counted_on_its_best_medium():
    index = KVIndex()
    index.apply("a", stored([1, 2, 3], "GPU"))
    index.apply("a", stored([3, 4], "CPU"))
    index.apply("b", stored([1, 2], "STORAGE"))
    index.apply("b", stored([4], "GPU"))  # past b's gap: not part of its prefix
    found = index.overlap([key(n) for n in (1, 2, 3, 4, 5)])
    assert found == {
        "a": Overlap(4, {"GPU": 3, "CPU": 1}),
        "b": Overlap(2, {"STORAGE": 2}),
    }


def test_removals_and_clears_take_blocks_away_per_medium_and_per_instance():
    index = KVIndex()
    index.apply("a", stored([1, 2], "GPU"))
    index.apply("a", stored([1, 2], "CPU"))
    index.apply("b", stored([1], "GPU"))
    index.apply("a", BlockRemoved(keys=(key(1),), medium="GPU"))
    assert index.overlap([key(1), key(2)])["a"] == Overlap(2, {"CPU": 1, "GPU": 1})
    index.apply("a", AllBlocksCleared(medium="CPU"))
    assert index.overlap([key(1), key(2)])["a"] == Overlap(0, {})
    assert index.overlap([key(1)])["b"] == Overlap(1, {"GPU": 1})
    index.clear("b")  # restarted, or found dead
    assert index.overlap([key(1)])["b"] == Overlap(0, {})
    assert index.overlap([key(2)])["a"] == Overlap(1, {"GPU": 1})
    assert len(index) == 1


def test_the_index_agrees_with_a_plain_follower_of_a_real_schedulers_events():
    """Two instances, each the scheduler of a seeded random run (every medium, evictions,
    Worker restarts): for every chain of keys the runs announced, and random mixtures of
    their keys, each instance's prefix is as long, and on the media, the follower's sets
    say."""
    index = KVIndex()
    held = {}
    prompts: list[list[BlockHash]] = []
    for name, seed in (("a", 3), ("b", 4)):
        journal = KVEventJournal(4, lineage=1000)
        driven(
            seed, device_blocks=8, host_blocks=8, requests=8, preemption="save",
            kv_events=journal,
        )  # fmt: skip
        events = journal.take()
        index.apply_all(name, events)
        held[name] = follow(events, 4, b"\0" * 16)
        prompts += [list(e.keys) for e in events if isinstance(e, BlockStored)]
    every = sorted({k for keys in prompts for k in keys})
    rng = random.Random(5)
    prompts += [rng.sample(every, rng.randint(1, 6)) for _ in range(200)]
    for keys in prompts:
        found = index.overlap(keys)
        for name, media in held.items():
            anywhere = set().union(*media.values())
            length = next((i for i, k in enumerate(keys) if k not in anywhere), len(keys))
            assert found[name].blocks == length, (name, keys)
            best: dict[str, int] = {}
            for k in keys[:length]:
                medium = next(m for m in ("GPU", "CPU", "STORAGE") if k in media[m])
                best[medium] = best.get(medium, 0) + 1
            assert found[name].on == best


def test_the_table_grows_and_rebuilds_keeping_every_live_block_in_under_64_bytes_each():
    index = KVIndex()
    rng = random.Random(7)
    live: set[int] = set()
    for _ in range(6):
        new = [rng.getrandbits(62) + 2 for _ in range(20_000)]
        index.apply("a", stored(new, "GPU"))
        live.update(new)
        gone = rng.sample(sorted(live), 8_000)
        index.apply("a", BlockRemoved(keys=tuple(key(n) for n in gone), medium="GPU"))
        live.difference_update(gone)
    assert len(index) == len(live)
    sample = rng.sample(sorted(live), 500)
    assert all(index.overlap([key(n)])["a"].blocks == 1 for n in sample)
    assert index.overlap([key(1)])["a"].blocks == 0
    assert index.bytes_per_block() < 64, index.bytes_per_block()


def test_limits_are_named():
    index = KVIndex()
    for n in range(MAX_INSTANCES):
        index.instance(f"i{n}")
    with pytest.raises(ValueError, match=f"at most {MAX_INSTANCES} instances"):
        index.instance("one more")
    with pytest.raises(ValueError, match="medium 'TAPE' is none of GPU, CPU, STORAGE"):
        index.apply("i0", stored([1], "TAPE"))

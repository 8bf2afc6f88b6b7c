"""The fenced topology and the KV layouts take the number of ranks from the config."""

from __future__ import annotations

import pytest

from ringfence.actors.config import Config
from ringfence.actors.engine import TOPOLOGY
from ringfence.actors.kv.layout import block_fingerprint, kv_layout
from ringfence.actors.model.config import ModelConfig, ParallelConfig
from ringfence.actors.model.shape import PRESETS
from ringfence.actors.preflight import check_model
from ringfence.actors.protocol.lanes import LANE_SLOTS, LANES, epoch_counter, lane_counter
from ringfence.actors.topology import FencedTopology
from ringfence.cache.fences import Lane, Tier
from ringfence.runtime.run import load_topology

TWO = Config(parallel=ParallelConfig(tp_size=2), model=ModelConfig(preset="small"))


def test_the_default_topology_is_built_from_the_runs_config_with_one_rank_by_default():
    topology = load_topology(Config())
    assert topology.actor("worker").ranks == topology.actor("store").ranks == 1
    assert topology.actor("engine").ranks == 1 and topology.actor("client").ranks == 4
    assert TOPOLOGY(Config()) == topology


def test_each_executor_runs_in_every_rank_with_a_ring_to_and_from_the_one_engine():
    topology = FencedTopology(engine="ringfence.actors.engine.actor:Engine").ranked(2)
    rings = {(link.src.id, link.dst.id) for link in topology.links()}
    for role in ("worker", "swap", "store"):
        for rank in range(2):
            assert {("engine-0", f"{role}-{rank}"), (f"{role}-{rank}", "engine-0")} <= rings
    assert len(rings) == 12  # no ring between ranks, none between executors
    (lanes,) = topology.counters
    assert (lanes.name, lanes.count) == (LANES, 2 * LANE_SLOTS)


def test_only_the_workers_ranks_restart_together():
    topology = FencedTopology(engine="ringfence.actors.engine.actor:Engine").ranked(2)
    together = {a.name: a.restart_together for a in topology.actors}
    assert together == {"engine": False, "worker": True, "swap": False, "store": False}


def test_every_ranks_watermarks_and_epochs_have_slots_of_their_own():
    class Block:
        count = 2 * LANE_SLOTS

        def __getitem__(self, index: int) -> int:
            return index

    block = Block()
    slots = {lane_counter(block, rank, lane) for rank in range(2) for lane in Lane}  # type: ignore[arg-type]
    slots |= {epoch_counter(block, rank, w) for rank in range(2) for w in ("tier", "issuer")}  # type: ignore[arg-type]
    assert len(slots) == 10 and max(slots) < block.count  # type: ignore[type-var,operator]
    with pytest.raises(ValueError, match="rank 2 has no step watermark"):
        lane_counter(block, 2, Lane.STEP)  # type: ignore[arg-type]


def test_a_rank_holds_its_share_of_the_kv_heads_of_every_block():
    one = kv_layout(Config(model=ModelConfig(preset="small")), Tier.DEVICE)
    two = kv_layout(TWO, Tier.DEVICE)
    assert PRESETS["small"].kv_heads == one.kv_heads == 2 * two.kv_heads
    assert 2 * two.block_bytes == one.block_bytes and two.num_blocks == one.num_blocks


def test_a_tp_size_that_does_not_divide_the_kv_heads_is_refused_naming_both():
    three = Config(parallel=ParallelConfig(tp_size=3), model=ModelConfig(preset="small"))
    with pytest.raises(ValueError, match=r"parallel.tp_size \(3\) must divide the model's 4 KV"):
        kv_layout(three, Tier.HOST)


def test_each_rank_stores_its_shard_under_a_fingerprint_of_its_own():
    digests = {block_fingerprint(TWO, "m", rank=rank).digest() for rank in range(2)}
    assert len(digests) == 2
    assert block_fingerprint(Config(), "m").digest() not in digests  # tp 1 is another layout
    assert block_fingerprint(TWO, "m", rank=1).tp_size == 2


def test_the_launch_refuses_a_tp_size_the_model_does_not_split_into_naming_both():
    assert Config.load(None, ["parallel.tp_size=2"]).parallel.tp_size == 2
    with pytest.raises(ValueError, match=r"^--set parallel.tp_size: must be >= 1, got 0$"):
        Config.load(None, ["parallel.tp_size=0"])
    config = Config.load(None, ["parallel.tp_size=4"])  # tiny: 4 heads but 2 KV heads
    with pytest.raises(ValueError, match=r"parallel.tp_size \(4\) must divide the model's 2 KV"):
        check_model(config)

"""An engine that publishes KV events (``events.enabled``), every actor in this process
(inproc.py): a subscriber written for vLLM replays the whole stream from the replay
socket, and what it then believes each tier holds is what the scheduler's pools hold;
every prompt's full blocks, hashed as a router would hash them (the instance's
fingerprint as namespace), were announced on the device tier."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
import zmq
from inproc import inproc_run
from kv_follow import follow
from random_workloads import ENGINE, RUN_TIMEOUT_S, TIERS, write_workload

from ringfence.actors.events.publisher import END_SEQ
from ringfence.actors.events.wire import decode_batch
from ringfence.cache.block_hash import block_keys
from ringfence.cache.ids import BlockId
from ringfence.cache.kv_events import AllBlocksCleared, BlockStored, KVEvent

WAIT_MS = 10_000


def replayed(endpoint: str) -> list[tuple[int, bytes]]:
    """Every batch the publisher kept, from 0, through its replay socket."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        batches: list[tuple[int, bytes]] = []
        while True:
            assert dealer.poll(WAIT_MS), "the replay did not answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                return batches
            batches.append((int.from_bytes(seq, "big"), payload))
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize("layout", ["map", "array"])
def test_a_follower_of_the_engines_events_holds_what_its_pools_hold(tmp_path, layout):
    workload = write_workload(tmp_path / "workload.jsonl", seed=31)
    sets = (*ENGINE, *TIERS, "events.enabled=true", f"events.layout={layout}",
            f"engine.workload={workload}")  # fmt: skip
    with inproc_run(tmp_path / "run", sets) as run:
        assert run.wait_shutdown(RUN_TIMEOUT_S), "the workload did not finish"
        engine: Any = run.actor("engine-0")
        batches = replayed(engine.kv_out.endpoints["replay_endpoint"])
        scheduler = engine.scheduler
        namespace = scheduler.config.namespace
        pools = {"GPU": scheduler.blocks.device, "CPU": scheduler.blocks.host}
        held_by_pools = {
            medium: {pool.key_of(BlockId(b)) for b in range(pool.num_blocks)} - {None}
            for medium, pool in pools.items()
        }
        stored = set(scheduler.blocks.stored.keys)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    events: list[KVEvent] = [e for _, payload in batches for e in decode_batch(payload).events]
    assert events[0] == AllBlocksCleared(medium=None)  # a new engine knows nothing before it
    held = follow(events, 4, namespace)
    assert held["GPU"] == held_by_pools["GPU"] and held["CPU"] == held_by_pools["CPU"]
    assert held["STORAGE"] and held["STORAGE"] <= stored
    announced = {k for e in events if isinstance(e, BlockStored) and e.medium == "GPU"
                 for k in e.keys}  # fmt: skip
    for line in workload.read_text().splitlines():
        prompt = orjson.loads(line)["prompt_token_ids"]
        assert set(block_keys(prompt, 4, namespace=namespace)) <= announced

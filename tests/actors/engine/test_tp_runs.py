"""Tensor parallelism end to end: N Worker ranks, each with its swap and store lanes, give
the tokens of the single-rank run without tiers, under chaos delays and poisoned blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from engine_runs import TIERS, finished, reference, workload_sets
from launching import launched

from ringfence.actors.config import Config
from ringfence.actors.engine.intake import load_workload
from ringfence.actors.kv.layout import block_fingerprint
from ringfence.actors.tools.testing.local import LocalRunner
from ringfence.actors.tools.testing.storage import read_blob, write_blob
from ringfence.cache.block_hash import block_keys
from ringfence.cache.storage.local import LocalBackend


def events(run_dir: Path, log: str, name: str) -> list[dict[str, Any]]:
    lines = (run_dir / f"{log}.jsonl").read_bytes().splitlines()
    return [e for e in map(orjson.loads, lines) if e["event"] == name]


def every_rank_ran_every_step(run_dir: Path, ranks: int) -> None:
    """Each rank's Worker finished the same steps with the same status, and only rank 0's
    results carry tokens (the engine's tokens come from rank 0)."""
    done = [
        [(e["step"], e["status"]) for e in events(run_dir, f"worker-{r}", "step.done")]
        for r in range(ranks)
    ]
    assert all(d == done[0] for d in done[1:]), "the ranks ran different steps"
    assert done[0] and all(status == "ok" for _, status in done[0])
    reduces = [e["reduces"] for e in events(run_dir, "worker-1", "step.done") if e["reduces"]]
    assert reduces, "rank 1 took part in no all-reduce"


@pytest.mark.parametrize(
    ("policy", "ranks", "preset"),
    [
        ("swap", 2, "tiny"),
        # Save preemption in the slow soak; CI runs each rank's store lane (prefetches with
        # misses) in the corrupt-storage test below and the swap lanes here.
        pytest.param("save", 2, "tiny", marks=pytest.mark.slow),
        pytest.param("swap", 4, "tiny-4kv", marks=pytest.mark.slow),
        pytest.param("recompute", 2, "tiny", marks=pytest.mark.slow),
    ],
)
def test_tp_ranks_give_the_single_rank_tokens_with_tiers_chaos_and_poison(
    tmp_path: Path, policy: str, ranks: int, preset: str
) -> None:
    expected = reference("pressure", preset)
    sets = workload_sets(
        "pressure",
        *TIERS,
        f"sched.preemption={policy}",
        f"parallel.tp_size={ranks}",
        f"model.preset={preset}",
    )
    with launched(tmp_path, *sets) as run:
        outputs, summary = finished(run)
    assert {o["id"]: tuple(o["token_ids"]) for o in outputs} == expected
    engine = summary["engine"]
    assert sum(engine["preemptions"].values()) > 0, engine
    moved = engine["blocks"]
    assert moved.get("swap_out" if policy == "swap" else "write_back", 0) > 0, engine
    every_rank_ran_every_step(run.run_dir, ranks)


def fill_rank_shards(config: Config, path: Path, turns: list[Any]) -> None:
    """A first instance, run in this process on the whole model: each block it stored is
    split by KV heads into the shards the ranks hold, each written under its rank's
    fingerprint (so the second instance also proves that rank r's KV is heads r*k..)."""
    runner = LocalRunner(config)
    records = runner.run(turns, arrivals=False)
    assert {r.id: r.token_ids for r in records} == {
        line.id: reference("multiturn")[line.id] for line in turns
    }
    ranks = config.parallel.tp_size
    for rank in range(ranks):
        store = LocalBackend(path, fingerprint=block_fingerprint(config, rank=rank).digest())
        try:
            blocks = []
            for key, block in runner.machine.storage.items():
                heads = block.shape[-2] // ranks
                shard = block[..., rank * heads : (rank + 1) * heads, :].contiguous()
                blocks.append((key, shard.numpy().data))
            assert store.put_many(blocks) == len(blocks) > 0
        finally:
            store.close()


def test_rank_1s_copy_corrupt_or_deleted_is_a_miss_on_every_rank_and_the_tokens_stay_exact(
    tmp_path: Path,
) -> None:
    """A first instance (in this process, on the whole model) fills a local tier with each
    rank's shard of every block; then rank 1's copy of block 1 of the shared prefix is
    corrupted and its copy of block 3 deleted, rank 0's left whole. The second tp 2
    instance's presence stops before block 3 (a prefix is stored only where every rank's
    block is), rank 1's prefetch reports block 1 missing, and the engine recomputes it on
    both ranks: the tokens are the single-rank reference's."""
    shared = tmp_path / "shared-storage"
    sets = (
        *workload_sets("multiturn", requests=4),
        "cache.host_blocks=0",
        "cache.device_eviction=write_through",
        "cache.storage.backend=local",
        f"cache.storage.path={shared}",
        "parallel.tp_size=2",
    )
    turns = load_workload("synthetic:multiturn", requests=4)  # the first chat's four turns
    expected = {line.id: reference("multiturn")[line.id] for line in turns}
    config = Config.load(None, sets)
    fill_rank_shards(config, shared, turns)
    prompt = turns[0].prompt_token_ids
    assert prompt is not None
    keys = block_keys(prompt, 16, namespace=block_fingerprint(config).digest())
    rank_1 = LocalBackend(shared, fingerprint=block_fingerprint(config, rank=1).digest())
    try:
        blob = read_blob(rank_1, keys[1])
        assert blob is not None and rank_1.longest_prefix(keys[:4]) == 4
        write_blob(rank_1, keys[1], blob[:100] + bytes([blob[100] ^ 0xFF]) + blob[101:])
        assert rank_1.delete([keys[3]]) == 1
    finally:
        rank_1.close()
    with launched(tmp_path, *sets, run_dir=tmp_path / "second") as run:
        outputs, _summary = finished(run)
    assert {o["id"]: tuple(o["token_ids"]) for o in outputs} == expected
    corrupt = {e["key"]: e["reason"] for e in events(run.run_dir, "store-1", "storage.corrupt")}
    assert corrupt == {keys[1].hex(): "checksum"}
    assert events(run.run_dir, "store-0", "storage.corrupt") == []
    reads = [
        [
            (e["op"], e["blocks"], e["missing"])
            for e in events(run.run_dir, f"store-{r}", "lane.done")
            if e.get("direction") == "read"
        ]
        for r in range(2)
    ]
    assert reads[0] and [op for op, _, _ in reads[0]] == [op for op, _, _ in reads[1]]
    assert reads[0][0][1] == 3, reads  # blocks 0..2: not 3, which rank 1 lacks
    assert reads[1][0][2] == [1] and reads[0][0][2] == [], reads

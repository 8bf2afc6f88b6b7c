"""Tensor parallelism end to end: N Worker ranks, each with its swap and store lanes, give
the tokens of the single-rank run without tiers, under chaos delays and poisoned blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from engine_runs import TIERS, finished, reference, workload_sets
from launching import launched


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
        ("save", 2, "tiny"),
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

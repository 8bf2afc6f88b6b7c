"""Launched engine runs on synthetic workloads, and what they are compared with.

``reference`` is the plain loop's tokens (``LocalRunner``: no tiers, a pool that never runs
out); ``finished`` waits for a run, replays it with ``--redrive`` and reads its outputs.
Shared by the engine, replay, storage and failed-op tests (and conftest's shared run).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import orjson
from launching import QUICK, Launch

from ringfence.actors.config import Config
from ringfence.actors.engine.intake import load_workload
from ringfence.actors.replay.checks import check_run
from ringfence.actors.replay.log import read_run
from ringfence.actors.replay.redrive import redrive
from ringfence.actors.tools.testing.local import LocalRunner

ENGINE = "runtime.topology=ringfence.actors.engine:TOPOLOGY"
MODEL = (ENGINE, "model.dtype=float64", "cache.block_size=16", "engine.progress=false")
TRACE = "runtime.log_level=trace"  # every run here is replayed (see finished)
TIERS = (
    "cache.host_blocks=24",
    "cache.storage.backend=local",
    "cache.poison_freed=true",
    "transfer.chaos_delay_ms=2",
)
SIZES = {"pressure": 4, "multiturn": 12}
DEVICE_BLOCKS = {"pressure": 48, "multiturn": 40}  # pressure: 4 requests need ~110 blocks


@cache
def reference(workload: str, preset: str = "tiny") -> dict[str, tuple[int, ...]]:
    """Output tokens per request of the plain loop (one rank, the whole model of
    ``preset``): no tiers, a pool that never runs out."""
    config = Config.load(
        None,
        [
            *MODEL,
            "cache.host_blocks=0",
            "cache.storage.backend=none",
            "cache.device_blocks=1024",
            f"model.preset={preset}",
        ],
    )
    lines = load_workload(f"synthetic:{workload}", requests=SIZES[workload])
    return {r.id: r.token_ids for r in LocalRunner(config).run(lines, arrivals=False)}


def finished(run: Launch, timeout: float = 180.0) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    assert run.wait(timeout) == 0, run.tail()
    replayed(run.run_dir)
    return results(run.run_dir)


def results(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    lines = (run_dir / "outputs.jsonl").read_bytes().splitlines()
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    return [orjson.loads(line) for line in lines], summary


def replayed(run_dir: Path, *, lost: int = 0, killed: str | None = None) -> None:
    """``ringfence replay --redrive`` on the run: every check holds, every decision repeats;
    nothing is left in flight but ``lost`` requests that died with a killed engine, and at
    most the one op that the ``killed`` executor (``worker-0``) completed and was killed
    before its report left."""
    log = read_run(run_dir)
    result = check_run(log)
    assert result.ok, [f"[{v.check}] {v.message}" for v in result.violations[:5]]
    died = [item for item in result.in_flight if "when engine pid" in item]
    # An op a killed executor completed: SIGKILL can land between its done watermark and its
    # report, which the engine then never applies (its restart cancels the op's epoch).
    mine = f"not applied: {killed} pid " if killed else None
    reported = [item for item in result.in_flight if mine and mine in item]
    assert len(reported) <= 1, result.in_flight
    # Ops a killed engine had in flight: executed or completed, never applied by it.
    orphans = [
        item
        for item in result.in_flight
        if "killed" in item and item not in died and item not in reported
    ]
    assert len(died) == lost, result.in_flight
    assert len(result.in_flight) == lost + len(orphans) + len(reported), result.in_flight
    assert lost or not orphans, result.in_flight
    if log.traced:
        outcome = redrive(log)
        assert outcome.divergence is None, outcome.divergence
        assert outcome.rounds > 0, outcome


def workload_sets(workload: str, *extra: str, requests: int | None = None) -> tuple[str, ...]:
    return (
        f"engine.workload=synthetic:{workload}",
        f"engine.requests={requests or SIZES[workload]}",
        "engine.arrivals=false",
        f"cache.device_blocks={DEVICE_BLOCKS[workload]}",
        *MODEL,
        TRACE,
        *QUICK,
        *extra,
    )

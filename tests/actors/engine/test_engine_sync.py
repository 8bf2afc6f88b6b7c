"""The engine in sync mode (each op held until the ops its fence names are done, then sent
with no fence), every actor in this process (inproc.py): the plain loop's tokens.

The launched form of this test (test_engine.py) is in the slow soak; this one pays no
process start-up.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from inproc import inproc_run
from random_workloads import ENGINE, RUN_TIMEOUT_S, TIERS, outputs, reference, write_workload


def run_against_the_plain_loop(tmp_path, seed: int, *sets: str) -> dict[str, Any]:
    """The random workload of ``seed`` in process with ``sets``: its outputs must be the
    plain loop's; the engine's summary."""
    workload = write_workload(tmp_path / "workload.jsonl", seed=seed)
    with inproc_run(
        tmp_path / "run", (*ENGINE, *TIERS, *sets, f"engine.workload={workload}")
    ) as run:
        assert run.wait_shutdown(RUN_TIMEOUT_S), "the workload did not finish"
        assert run.failures() == {}
    assert outputs(tmp_path / "run") == reference(workload)
    summary = orjson.loads((tmp_path / "run" / "summary.json").read_bytes())
    engine: dict[str, Any] = summary["engine"]
    return engine


@pytest.mark.parametrize(
    ("policy", "eviction"), [("save", "write_through"), ("swap", "write_back")]
)
def test_in_sync_mode_every_request_gets_the_plain_loops_tokens(tmp_path, policy, eviction):
    engine = run_against_the_plain_loop(
        tmp_path,
        11,
        "transfer.mode=sync",
        "transfer.chaos_delay_ms=1",
        f"sched.preemption={policy}",
        f"cache.device_eviction={eviction}",
    )
    assert engine["mode"] == "sync" and engine["preemptions"].get(policy, 0) > 0, engine


def test_in_lock_mode_with_polling_actors_every_request_gets_the_plain_loops_tokens(tmp_path):
    """The legacy baselines together: the lock around every step and copy, and every idle
    wait a 1 ms poll. Slower, never different. (That the lock excludes is tested in
    test_transfer.py and test_legacy.py; here each executor held one.)"""
    engine = run_against_the_plain_loop(
        tmp_path,
        12,
        "transfer.mode=lock",
        "runtime.wait=poll",
        "sched.preemption=swap",
        "cache.device_eviction=write_back",
    )
    assert engine["mode"] == "lock" and engine["preemptions"].get("swap", 0) > 0, engine
    assert (tmp_path / "run" / "legacy-0.lock").exists()
    waits = [
        line["waits"]
        for path in (tmp_path / "run").glob("*.jsonl")
        for line in map(orjson.loads, path.read_bytes().splitlines())
        if line.get("event") == "legacy.lock"
    ]
    assert len(waits) == 3, waits  # the Worker and both lanes

"""The Worker as a process under the supervisor, driven by a scripted engine (fixture_worker).

The engine checks every generated token against a contiguous forward of the same model
and writes its verdict into the run dir; the tests read it with the logs.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import orjson
import pytest
from fixture_worker import DECODE, PAUSE_AT, SEQUENCES, VERDICT
from launching import QUICK, launched

from ringfence.shm import names

SETTINGS = (
    "model.preset=tiny",
    "model.dtype=float64",
    "model.seed=3",
    "cache.block_size=4",
    "cache.device_blocks=96",
    "cache.poison_freed=true",  # every block starts NaN: a read of an unwritten one shows
    "actors.worker.backoff_s=0.1",
    "actors.worker.threads=1",
    "runtime.heartbeat_timeout_s=4.0",  # the worker's fence wait gives up after 2 s
    *QUICK,
)


def verdict(run_dir: Path) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads((run_dir / VERDICT).read_bytes())
    return data


@pytest.mark.slow  # the engine tests run launched workers end to end in CI
def test_a_launched_worker_runs_a_scripted_program_to_the_contiguous_forwards_tokens(tmp_path):
    with launched(tmp_path, "runtime.topology=fixture_worker:SCRIPTED", *SETTINGS) as run:
        assert run.wait() == 0, run.tail()
        result = verdict(run.run_dir)
        assert result["failure"] == "" and result["mismatches"] == []
        assert all(len(tokens) == DECODE for tokens in result["generated"].values())
        assert len(result["generated"]) == SEQUENCES
        [ready] = run.events("worker.ready", log="worker-0")
        assert ready["kv_shm"] == names.posix_name(run.run_id, "kv.device.0")
        assert ready["threads"] == 1  # actors.worker.threads reached torch in the child
        steps = run.events("step.done", log="worker-0")
        assert [s["step"] for s in steps] == list(range(1, len(steps) + 1))
        assert {s["status"] for s in steps} == {"ok"}
    assert names.list_names(run.run_id) == []  # the KV segment went with the run


# Slow: CI kills the Worker under the real engine, twice, in test_faults.py.
@pytest.mark.slow
def test_a_killed_worker_is_restarted_cancels_the_plan_it_was_handed_again_and_recomputes(
    tmp_path,
):
    with launched(tmp_path, "runtime.topology=fixture_worker:RESTART", *SETTINGS) as run:
        run.wait_ready()
        # The plan after PAUSE_AT waits for a swap that never comes; kill the worker there.
        run.wait_for_event("msg.deferred", log="worker-0", timeout=30.0)
        run.kill_actor("worker-0")
        assert run.wait() == 0, run.tail()
        result = verdict(run.run_dir)
        assert result["failure"] == "" and result["mismatches"] == []
        assert [(r["incarnation"], r["epoch"]) for r in result["readies"]] == [(1, 0), (2, 1)]
        assert result["readies"][1]["step_done"] == PAUSE_AT
        stuck = PAUSE_AT + 1
        [cancelled] = [r for r in result["results"] if r["step"] == stuck]
        assert cancelled["status"] == "cancelled" and "epoch 0" in cancelled["error"]
        exits = run.events("actor.exit", instance="worker-0")
        assert exits[0]["exitcode"] == -signal.SIGKILL
        readies = run.events("worker.ready", log="worker-0")
        assert len({r["kv_shm"] for r in readies}) == 1  # the restart mapped the same segment

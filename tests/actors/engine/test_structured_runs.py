"""Structured outputs through whole runs (issue 38): fifty seeded, sampled requests against a
nested JSON schema, a regex and a choice (``structured_workloads.py``) on the tiny preset.

Every output ends at the grammar's end token and is valid for its kind, and every run's
tokens equal the plain loop's (which never preempts): so under swap, recompute or save
preemption with a small device pool, chaos delays and poisoned blocks, and across a Worker
killed mid-run, each matcher was rebuilt from the sequence's output and masked exactly as
an undisturbed one would have.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from engine_runs import TRACE, replayed
from inproc import inproc_run
from launching import QUICK, launched
from random_workloads import ENGINE, RUN_TIMEOUT_S, outputs, reference
from structured_workloads import check_output, write

SEED = 38
SMALL_POOL = (
    "cache.device_blocks=32",  # one request needs up to 27 blocks: fifty contend for 32
    "cache.host_blocks=64",
    "cache.storage.backend=local",
    "cache.poison_freed=true",
    "transfer.chaos_delay_ms=1",
)


def preemptions(run_dir: Path) -> int:
    summary = orjson.loads((run_dir / "summary.json").read_bytes())
    return int(sum(summary["engine"]["preemptions"].values()))


@pytest.fixture(scope="module")
def workload(tmp_path_factory) -> tuple[Path, dict[str, tuple[int, ...]]]:
    """The workload and the plain loop's tokens for it, every output checked."""
    print(f"structured workload seed {SEED}")
    path = write(tmp_path_factory.mktemp("structured") / "workload.jsonl", seed=SEED)
    expected = reference(path)
    assert len(expected) == 50
    for request_id, tokens in expected.items():
        check_output(request_id, tokens)
    return path, expected


def test_the_plain_loops_outputs_are_valid_and_differ_as_their_seeds_do(workload):
    _, expected = workload
    texts = {rid: check_output(rid, tokens) for rid, tokens in expected.items()}
    # Sampled, not stuck on one answer: the grammar narrows the draw, it does not make it.
    assert len({texts[f"json{i}"] for i in range(20)}) > 10
    assert len({texts[f"regex{i}"] for i in range(15)}) > 10
    assert len({texts[f"choice{i}"] for i in range(15)}) > 1


@pytest.mark.parametrize("policy", ["swap", "recompute", "save"])
def test_preempted_constrained_requests_get_the_plain_loops_valid_tokens(
    tmp_path, workload, policy
):
    path, expected = workload
    sets = (*ENGINE, *SMALL_POOL, f"sched.preemption={policy}", f"engine.workload={path}")
    with inproc_run(tmp_path / "run", sets) as run:
        assert run.wait_shutdown(RUN_TIMEOUT_S * 6), "the workload did not finish"
        assert run.failures() == {}
    got = outputs(tmp_path / "run")
    for request_id, tokens in got.items():
        check_output(request_id, tokens)
    assert got == expected
    assert preemptions(tmp_path / "run") > 0, "the pool was large enough: nothing was preempted"


def test_a_worker_killed_mid_run_rebuilds_every_matcher_from_the_output(tmp_path, workload):
    path, expected = workload
    sets = (*ENGINE, *QUICK, TRACE, "cache.device_blocks=256", f"engine.workload={path}")
    with launched(tmp_path, *sets) as run:
        run.wait_for_event("step.done", log="worker-0", step=40, timeout=120.0)
        run.kill_actor("worker-0")
        assert run.wait(180.0) == 0, run.tail()
        restarts = run.events("worker.ready", log="worker-0")
    assert len(restarts) == 2, "the worker was not restarted"
    # The checks hold, and the redriven scheduler (the requests' structured outputs read
    # back from the log) repeats every decision.
    replayed(tmp_path / "run", killed="worker-0")
    got = outputs(tmp_path / "run")
    for request_id, tokens in got.items():
        check_output(request_id, tokens)
    assert got == expected

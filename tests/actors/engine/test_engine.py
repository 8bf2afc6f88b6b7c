"""The whole system on workloads: the actor pipeline's tokens equal the plain reference's.

Each run launches the engine topology (Engine, Worker, swap and store lanes as
processes) on a synthetic workload with the host and storage tiers on, chaos delays
and poisoned blocks, in float64, and compares every request's output tokens with
the in-process runner (``LocalRunner``) on the same model with both tiers off and a
device pool large enough that nothing is ever preempted.
"""

from __future__ import annotations

import contextlib

import orjson
import pytest
from engine_runs import (
    MODEL,
    TIERS,
    finished,
    reference,
    results,
    workload_sets,
)
from launching import QUICK, launched

from ringfence.actors.config import Config
from ringfence.actors.engine.intake import load_workload
from ringfence.actors.tools.testing.local import LocalRunner
from ringfence.actors.tools.testing.redis_server import REDIS_SERVER, redis_server


@pytest.mark.parametrize(
    ("workload", "policy"),
    [
        ("pressure", "swap"),
        pytest.param("multiturn", "swap", marks=pytest.mark.slow),
        # The rest of the matrix: the slow soak (`scripts/test -m slow`). Recompute runs
        # in CI in sync mode and save in sync mode with write-through (the sync tests),
        # multiturn in the shared-storage test.
        pytest.param("pressure", "recompute", marks=pytest.mark.slow),
        pytest.param("pressure", "save", marks=pytest.mark.slow),
        pytest.param("multiturn", "recompute", marks=pytest.mark.slow),
        pytest.param("multiturn", "save", marks=pytest.mark.slow),
    ],
)
def test_under_chaos_and_poison_every_request_gets_the_tokens_of_the_run_without_tiers(
    tmp_path, request, workload, policy
):
    expected = reference(workload)
    if (workload, policy) == ("pressure", "swap"):
        outputs, summary = results(request.getfixturevalue("pressure_swap_run"))
    else:
        sets = workload_sets(workload, *TIERS, f"sched.preemption={policy}")
        with launched(tmp_path, *sets) as run:
            outputs, summary = finished(run)
    assert {o["id"]: tuple(o["token_ids"]) for o in outputs} == expected
    assert summary["requests"]["finished"] == len(expected)
    engine = summary["engine"]
    if workload == "pressure":
        # The pool is far too small for the four at once: the policy really ran.
        assert sum(engine["preemptions"].values()) > 0, engine
    moved = engine["blocks"]
    assert moved.get("swap_out", 0) > 0, engine


# Both in the slow soak: CI shares a local tier between two instances in
# test_storage_runs.py (its second reads what the first wrote) and runs redis there.
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "redis"])
def test_a_second_instance_on_the_same_storage_takes_its_prefixes_from_the_first(tmp_path, backend):
    with contextlib.ExitStack() as stack:
        if backend == "redis":
            if REDIS_SERVER is None:
                pytest.skip("redis-server is not on PATH (scripts/test installs it as root)")
            (tmp_path / "redis").mkdir()
            url = stack.enter_context(redis_server(tmp_path / "redis"))
            place = f"cache.storage.url={url}"
        else:
            place = f"cache.storage.path={tmp_path / 'shared-storage'}"
        sets = workload_sets(
            "multiturn",
            "cache.host_blocks=0",  # nothing kept on host: reuse across instances is storage only
            f"cache.storage.backend={backend}",
            place,
            "cache.device_eviction=write_through",
            requests=4,  # one chat's four turns
        )
        check_second_instance(tmp_path, sets)


def check_second_instance(tmp_path, sets):
    with launched(tmp_path, *sets, run_dir=tmp_path / "first") as run:
        first, _ = finished(run)
    with launched(tmp_path, *sets, run_dir=tmp_path / "second") as run:
        second, summary = finished(run)
    assert [o["token_ids"] for o in first] == [o["token_ids"] for o in second]
    assert second[0]["cached_tokens"]["storage"] > 0, second[0]
    assert summary["cached_tokens"]["storage"] > 0
    expected = reference("multiturn")
    assert {o["id"]: tuple(o["token_ids"]) for o in second} == {
        o["id"]: expected[o["id"]] for o in second
    }


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["recompute", "swap", "save"])
def test_with_write_through_on_both_tiers_every_policy_gets_the_reference_tokens(tmp_path, policy):
    sets = workload_sets(
        "pressure",
        *TIERS,
        f"sched.preemption={policy}",
        "cache.device_eviction=write_through",
        "cache.host_eviction=write_through",
    )
    with launched(tmp_path, *sets) as run:
        outputs, _ = finished(run)
    assert {o["id"]: tuple(o["token_ids"]) for o in outputs} == reference("pressure")


@pytest.mark.parametrize(
    ("policy", "eviction"),
    # Both slow (CI time): CI runs sync mode with every actor in its process, test_engine_sync.py.
    [
        pytest.param("save", "write_through", marks=pytest.mark.slow),
        pytest.param("recompute", "write_back", marks=pytest.mark.slow),
    ],
)
def test_sync_mode_gives_the_same_tokens(tmp_path, policy, eviction):
    sets = workload_sets(
        "pressure",
        *TIERS,
        f"sched.preemption={policy}",
        f"cache.device_eviction={eviction}",
        "transfer.mode=sync",
    )
    with launched(tmp_path, *sets) as run:
        outputs, summary = finished(run)
    assert {o["id"]: tuple(o["token_ids"]) for o in outputs} == reference("pressure")
    assert summary["engine"]["mode"] == "sync"
    assert sum(summary["engine"]["preemptions"].values()) > 0


def test_a_workload_file_with_text_prompts_and_arrivals_runs_and_prints_a_summary(tmp_path):
    lines = [
        {"id": "text", "prompt": "The fence holds.", "max_tokens": 5},
        {"id": "ids", "prompt_token_ids": [72, 105, 33], "max_tokens": 3, "arrival_s": 0.5},
    ]
    path = tmp_path / "workload.jsonl"
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    sets = (*MODEL, f"engine.workload={path}", *QUICK)
    with launched(tmp_path, *sets) as run:
        outputs, summary = finished(run)
        printed = run.stdout()
    config = Config.load(None, MODEL)
    expected = LocalRunner(config).run(load_workload(str(path)), arrivals=False)
    assert [(o["id"], o["token_ids"]) for o in outputs] == [
        (r.id, list(r.token_ids)) for r in expected
    ]
    assert outputs[0]["token_ids"] and len(outputs[1]["token_ids"]) == 3
    assert summary["requests"]["total"] == 2 and summary["duration_s"] >= 0.5
    assert "throughput" in printed and "TTFT" in printed, printed

"""Two steps in flight in a launched run (``sched.steps_in_flight = 2``): the engine plans
step N+1 while step N runs, and the tokens equal the plain loop's.

The run is the engine tests' (``tests/engine_runs.py``): the engine topology as processes
on a synthetic workload in float64, host and storage tiers on, chaos delays on every
transfer op and poisoned freed blocks, traced, then checked by ``ringfence replay`` and
re-driven (``finished``). The sampling knobs in a run in this process (``inproc.py``): a
knob the Worker counts tokens for (penalties) must count the token it put in, not the
placeholder. Last, the settings: where two fall back to one, and what is refused.
"""

from __future__ import annotations

import orjson
import pytest
from engine_runs import TIERS, finished, reference, replayed, results, workload_sets
from inproc import inproc_run
from launching import launched
from random_workloads import ENGINE, RUN_TIMEOUT_S, outputs
from random_workloads import TIERS as SMALL_TIERS
from random_workloads import reference as plain_tokens

from ringfence.actors.config import Config
from ringfence.actors.engine.begin import sched_config
from ringfence.actors.replay.log import read_run


def most_steps_in_flight(run_dir) -> int:
    """The most steps the engine had issued and not yet applied at once, from its trace
    (``op.issue`` of a step, ``sched.step`` when its result is applied)."""
    issued = applied = most = 0
    for entry in read_run(run_dir).sources["engine-0"]:
        if entry.event == "op.issue" and entry.data.get("lane") == "step":
            issued = int(entry.data["op"])
        elif entry.event == "sched.step":
            applied = int(entry.data["step"])
        most = max(most, issued - applied)
    return most


def test_two_steps_in_flight_under_chaos_and_poison_give_the_plain_loops_tokens(tmp_path):
    # The Worker checks the next plan while a step runs (model.look_ahead, on for a GPU),
    # and launches it before it reports the step before where its fence is met
    # (model.launch_ahead, on for a GPU), here on the CPU too: the plans it read ahead are
    # handled in order, once each, and those launched ahead give the plain loop's tokens,
    # those launched early (before the step before's tokens were read back, their inputs
    # taken from its draw on the device) among them.
    sets = workload_sets(
        "pressure", *TIERS, "sched.preemption=swap", "sched.steps_in_flight=2",
        "model.look_ahead=on", "model.launch_ahead=on",
    )  # fmt: skip
    with launched(tmp_path, *sets) as run:
        outputs, summary = finished(run)  # replay's checks and --redrive hold
    assert {o["id"]: tuple(o["token_ids"]) for o in outputs} == reference("pressure")
    engine = summary["engine"]
    assert sum(engine["preemptions"].values()) > 0, engine  # the pool really ran short
    assert most_steps_in_flight(run.run_dir) == 2
    done = [e.data for e in read_run(run.run_dir).sources["worker-0"] if e.event == "step.done"]
    ahead = [d for d in done if d["checked_ahead"]]
    assert ahead and all(d["status"] == "ok" for d in ahead), len(done)
    launched_ahead = [d for d in done if d.get("launched_ahead")]
    assert launched_ahead and all(d["checked_ahead"] for d in launched_ahead), len(done)
    assert any(d["launched_ahead"] == "early" for d in launched_ahead), len(done)
    # A plan whose fence waits on a swap is never launched ahead: every one that was saw
    # the watermarks its fence names reached at its launch.
    for d in launched_ahead:
        assert (d["seen_swap"] or 0) >= d["fence_swap"] and (d["seen_store"] or 0) >= d[
            "fence_store"
        ]


@pytest.mark.parametrize(
    "launch",
    [(), ("model.look_ahead=on", "model.launch_ahead=on")],
    ids=["at-each-turn", "launched-early"],
)
def test_a_worker_killed_with_two_steps_in_flight_costs_recomputation_not_tokens(tmp_path, launch):
    # Launched early, a step may be on the device behind the one that runs when the Worker
    # dies: both die with it, and the restarted Worker cancels their plans as stale.
    sets = workload_sets(
        "pressure", *TIERS, "sched.preemption=swap", "sched.steps_in_flight=2", *launch
    )
    with launched(tmp_path, *sets) as run:
        run.wait_for_event("step.done", log="worker-0", step=30, timeout=120.0)
        run.kill_actor("worker-0")
        assert run.wait(180.0) == 0, run.tail()
        restarts = run.events("worker.ready", log="worker-0")
    assert len(restarts) == 2, "the worker was not restarted"
    replayed(run.run_dir, killed="worker-0")  # both steps in flight lost, none applied
    outputs, _ = results(run.run_dir)
    assert {o["id"]: tuple(o["token_ids"]) for o in outputs} == reference("pressure")
    if launch:
        steps = worker_steps(run.run_dir)
        assert any(d.get("launched_ahead") == "early" for d in steps), len(steps)


def test_one_step_in_flight_is_the_default(pressure_swap_run):
    # The session's traced pressure run (tests/conftest.py), launched on the defaults but
    # for its tiers and swap preemption: the same workload as above with one step in flight.
    assert Config.load(None, []).sched.steps_in_flight == 1
    outputs, _ = results(pressure_swap_run)
    assert {o["id"]: tuple(o["token_ids"]) for o in outputs} == reference("pressure")
    assert most_steps_in_flight(pressure_swap_run) == 1


@pytest.mark.parametrize(
    "launch",
    [(), ("model.look_ahead=on", "model.launch_ahead=on")],
    ids=["at-each-turn", "launched-early"],
)
def test_two_steps_in_flight_keep_every_knobs_tokens(tmp_path, launch):
    # Launched early (model.launch_ahead, a GPU's default; here on the CPU), a decode takes
    # its input from the step before's draw on the device, and a penalty counts it there.
    prompts = ([5, 6, 7, 5, 6, 7, 5, 6, 7, 9], [40, 41, 40, 41, 40, 2])
    greedy = tmp_path / "greedy.jsonl"
    write_lines(greedy, [{"id": f"g{i}", "prompt_token_ids": p} for i, p in enumerate(prompts)])
    plain = plain_tokens(greedy)
    lines = []
    for i, prompt in enumerate(prompts):
        base = {"prompt_token_ids": prompt, "max_tokens": 10, "seed": i}
        stop = plain[f"g{i}"][3]  # the greedy line stops at its 4th token at the latest
        lines += [
            {"id": f"greedy{i}", **base},
            {"id": f"repetition{i}", **base, "repetition_penalty": 2.0},
            {"id": f"frequency{i}", **base, "frequency_penalty": 2.0},
            {"id": f"presence{i}", **base, "presence_penalty": 2.0},
            {"id": f"hot{i}", **base, "temperature": 1.5, "top_k": 3, "min_p": 0.05},
            {"id": f"stops{i}", **base, "stop_token_ids": [stop], "min_tokens": 2},
        ]
    workload = write_lines(tmp_path / "workload.jsonl", lines)
    sets = (*ENGINE, *SMALL_TIERS, f"engine.workload={workload}", "sched.steps_in_flight=2")
    with inproc_run(tmp_path / "run", (*sets, *launch)) as run:
        assert run.wait_shutdown(RUN_TIMEOUT_S), "the workload did not finish"
        assert run.failures() == {}
    got = outputs(tmp_path / "run")
    if launch:
        early = [e for e in worker_steps(tmp_path / "run") if e.get("launched_ahead") == "early"]
        assert early, "no step was launched early"
    assert got == plain_tokens(workload)
    for i in range(len(prompts)):  # a stop ended it while its next decode was planned
        assert 3 <= len(got[f"stops{i}"]) <= 4 and got[f"stops{i}"][-1] == plain[f"g{i}"][3]


def worker_steps(run_dir) -> list[dict[str, object]]:
    """Worker 0's ``step.done`` lines."""
    return [e.data for e in read_run(run_dir).sources["worker-0"] if e.event == "step.done"]


def write_lines(path, lines):
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path


@pytest.mark.parametrize(
    ("sets", "steps"),
    [
        ((), 2),
        (("parallel.tp_size=2",), 1),  # rank 0 alone samples: the others lack the token
        (("engine.role=prefill", "cache.storage.path=/tmp/tier"), 1),  # hands over at the end
    ],
)
def test_two_steps_in_flight_fall_back_to_one_where_they_cannot_hold(sets, steps):
    config = Config.load(None, ["sched.steps_in_flight=2", *sets])
    assert sched_config(config, "m", 2048).steps_in_flight == steps


def test_more_than_two_steps_in_flight_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"sched\.steps_in_flight"):
        Config.load(None, ["sched.steps_in_flight=3"])

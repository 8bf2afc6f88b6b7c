"""Actors SIGKILLed in the middle of real runs lose no request and change no token.

Each test runs a scenario of ``ringfence bench faults`` (actors/tools/bench/faults/runner.py):
the engine topology on the ``pressure`` workload with swap preemption, host and local
storage tiers, chaos delays and poisoned blocks, in float64; the kills land on live children
of the launch once the Worker has done the given steps. Every completed request must
have exactly the tokens of the plain in-process loop with no tiers, the run must end
by itself with the status expected, leave no shared-memory name, and
``ringfence replay --redrive`` must pass on its logs.
"""

from __future__ import annotations

import pytest

from ringfence.actors.tools.bench.faults.matrix import matrix
from ringfence.actors.tools.bench.faults.runner import (
    NEVER,
    PRESSURE,
    SAVE,
    SUPERVISOR,
    Kill,
    Outcome,
    Scenario,
    kills,
    run_scenario,
)


def judged(outcome: Outcome, *, completed: int) -> None:
    assert outcome.notes == [], outcome
    assert outcome.hangs == 0 and outcome.leaked_names == 0, outcome
    assert outcome.completed == completed and outcome.wrong_tokens == 0, outcome
    assert outcome.replay == "ok", outcome.replay


# Before each kill the runner waits for the last victim's restart (Launch.settle). A run goes
# on without a lane until it needs one, so after a lane's kill it may reach its end before
# the lane is back, and a later kill would find no run to land in: under load a lane's
# restart took 3.2 s, and the whole run 3.5 s. A run cannot go on without its Worker, so
# in CI a lane is killed only last, after the Worker's kill; the slow matrix below kills
# each lane again and again.


def test_a_kill_of_the_worker_and_then_of_the_store_lane_lose_no_request_or_token(tmp_path):
    kill = (Kill("worker-0", 10), Kill("store-0", 25))
    scenario = Scenario("lanes and worker", "pressure", 4, PRESSURE, kill)
    outcome = run_scenario(scenario, tmp_path, timeout=240)
    assert outcome.injected == len(kill) and outcome.exit_code == 0
    judged(outcome, completed=4)


def test_at_tp_2_a_worker_rank_and_then_a_ranks_swap_lane_killed_lose_nothing(tmp_path):
    """docs/design.md, "Ranks (tensor parallelism)": the killed Worker rank takes its group
    down, both ranks restart together under a new tier epoch; the lane restarts alone and
    redoes its op."""
    kill = (Kill("worker-1", 10), Kill("swap-1", 30))
    sets = (*PRESSURE, "parallel.tp_size=2")
    scenario = Scenario("tp2 rank lane and worker rank", "pressure", 4, sets, kill)
    outcome = run_scenario(scenario, tmp_path, timeout=300)
    assert outcome.injected == len(kill) and outcome.exit_code == 0
    judged(outcome, completed=4)
    run_dir = tmp_path / "tp2-rank-lane-and-worker-rank" / "run"
    supervisor = (run_dir / "supervisor-0.jsonl").read_text()
    assert supervisor.count('"event":"actor.group_restart"') == 1


@pytest.mark.slow
def test_a_killed_engine_is_restarted_and_runs_its_workload_again_to_the_same_tokens(tmp_path):
    scenario = Scenario("engine", "pressure", 4, PRESSURE, kills("engine-0", 30))
    outcome = run_scenario(scenario, tmp_path)
    assert outcome.exit_code == 0
    judged(outcome, completed=4)


@pytest.mark.slow
def test_a_killed_engine_that_may_not_restart_ends_the_run_with_status_1_and_no_hang(tmp_path):
    scenario = Scenario(
        "engine never", "pressure", 4, (*PRESSURE, NEVER), kills("engine-0", 30), expect_exit=1
    )
    outcome = run_scenario(scenario, tmp_path)
    assert outcome.exit_code == 1
    judged(outcome, completed=0)


@pytest.mark.slow
def test_after_the_supervisor_is_killed_its_actors_exit_and_clean_leaves_no_name(tmp_path):
    scenario = Scenario(
        "supervisor", "pressure", 4, PRESSURE, kills(SUPERVISOR, 30), expect_exit=-9
    )
    outcome = run_scenario(scenario, tmp_path)
    judged(outcome, completed=0)


@pytest.mark.slow
def test_the_store_lane_killed_again_and_again_under_save_preemption_loses_nothing(tmp_path):
    scenario = Scenario("store", "pressure", 8, SAVE, kills("store-0", 12, 40, 90, 150))
    judged(run_scenario(scenario, tmp_path), completed=8)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", matrix(quick=False), ids=lambda s: s.name)
def test_every_row_of_the_fault_matrix_holds(scenario, tmp_path):
    outcome = run_scenario(scenario, tmp_path)
    assert outcome.ok, outcome

"""The swap lane hosted in the Worker's process (``actors.swap.placement = "hosted"``,
``actors.swap.host = "worker"``): on a GPU its copies then share the Worker's CUDA context.

The runs are the engine tests' (``tests/engine_runs.py``): the engine topology on a
synthetic workload in float64, host and storage tiers on, chaos delays on every transfer op
and poisoned freed blocks, traced, then checked by ``ringfence replay`` and re-driven. The
swap lane is still its own lane: its own ring, watermark, log and incarnations, fenced as
before; only its process is the Worker's.
"""

from __future__ import annotations

import pytest
from engine_runs import TIERS, finished, reference, replayed, results, workload_sets
from launching import Launch, launched

HOSTED_SWAP = ("actors.swap.placement=hosted", "actors.swap.host=worker")


def started_in(run: Launch, instance: str) -> list[tuple[int, int, str]]:
    """(incarnation, pid, placement) of each start of ``instance``, from its own log."""
    return [
        (e["incarnation"], e["pid"], e["placement"])
        for e in run.events("actor.start", log=instance)
    ]


def swaps_done(run: Launch) -> int:
    """Swap ops the swap lane completed ok, across its incarnations."""
    return len(run.events("lane.done", log="swap-0", lane="swap", status="ok"))


def test_a_hosted_swap_lane_under_chaos_and_poison_failing_once_gives_the_plain_loops_tokens(
    tmp_path,
):
    # Its first incarnation raises on its third swap op, before the op runs: the Worker's
    # process lives on (one incarnation, its model and device tier untouched), and the lane's
    # next incarnation attaches on a thread of it and redoes the op from its ring.
    sets = workload_sets(
        "pressure",
        *TIERS,
        "sched.preemption=swap",
        *HOSTED_SWAP,
        "runtime.topology=fixture_lanes:BREAKING_SWAP",
        "actors.swap.backoff_s=0.05",
    )
    with launched(tmp_path, *sets) as run:
        outputs, summary = finished(run)  # replay's checks and --redrive hold
        swaps = swaps_done(run)
        (worker,) = started_in(run, "worker-0")
        assert started_in(run, "swap-0") == [(1, worker[1], "hosted"), (2, worker[1], "hosted")]
        (exited,) = run.events("actor.exit", instance="swap-0")
        assert (exited["incarnation"], exited["clean"], exited["where"]) == (1, False, "loop")
        assert exited["error"].startswith("LaneBroke: fixture swap lane breaks at its op")
        assert run.events("actor.exit", instance="worker-0")[0]["clean"] is True
    assert {o["id"]: tuple(o["token_ids"]) for o in outputs} == reference("pressure")
    engine = summary["engine"]
    assert engine["preemptions"]["swap"] > 0, engine  # the pool really ran short
    assert swaps > 0


def test_a_hosted_swap_lane_beside_steps_launched_early_gives_the_plain_loops_tokens(tmp_path):
    # A GPU's defaults together: two steps in flight, the next launched while a step lands
    # (on its tokens on the device), and the swap lane on a thread of the Worker's process,
    # under chaos and poison.
    sets = workload_sets(
        "pressure", *TIERS, "sched.preemption=swap", *HOSTED_SWAP, "sched.steps_in_flight=2",
        "model.look_ahead=on", "model.launch_ahead=on",
    )  # fmt: skip
    with launched(tmp_path, *sets) as run:
        outputs, summary = finished(run)  # replay's checks and --redrive hold
        swaps = swaps_done(run)
        early = run.events("step.done", log="worker-0", launched_ahead="early")
    assert {o["id"]: tuple(o["token_ids"]) for o in outputs} == reference("pressure")
    assert summary["engine"]["preemptions"]["swap"] > 0 and swaps > 0
    assert early, "no step was launched early"


# CI runs the tp 2 kill below, which takes both ranks' hosted lanes down and back; the
# fault matrix (`ringfence bench faults`) kills a hosted lane three times.
@pytest.mark.slow
def test_a_kill_of_the_hosted_lanes_process_costs_recomputation_not_tokens(tmp_path):
    sets = workload_sets("pressure", *TIERS, "sched.preemption=swap", *HOSTED_SWAP)
    with launched(tmp_path, *sets) as run:
        run.wait_for_event("lane.done", log="swap-0", lane="swap", timeout=120.0)
        pid = run.kill_actor("swap-0")  # the Worker's process: both go, both come back
        assert run.wait(180.0) == 0, run.tail()
        starts = started_in(run, "swap-0")
        workers = started_in(run, "worker-0")
    assert [s[0] for s in starts] == [1, 2]
    assert [s[1] for s in starts] == [w[1] for w in workers]
    assert workers[0][1] == pid
    replayed(run.run_dir, killed="worker-0")
    outputs, _ = results(run.run_dir)
    assert {o["id"]: tuple(o["token_ids"]) for o in outputs} == reference("pressure")


def test_at_tp_2_a_killed_worker_rank_takes_both_hosted_lanes_along_and_loses_no_token(tmp_path):
    # Rank 1's process dies with its hosted lane; the group restart kills rank 0's process and
    # its lane too; every rank and lane comes back under one new generation.
    sets = workload_sets(
        "pressure", *TIERS, "sched.preemption=swap", "parallel.tp_size=2", *HOSTED_SWAP
    )
    with launched(tmp_path, *sets) as run:
        run.wait_for_event("lane.done", log="swap-1", lane="swap", timeout=120.0)
        run.kill_actor("worker-1")
        assert run.wait(180.0) == 0, run.tail()
        for rank in (0, 1):
            lanes, workers = started_in(run, f"swap-{rank}"), started_in(run, f"worker-{rank}")
            assert [s[0] for s in lanes] == [1, 2]
            assert [s[1] for s in lanes] == [w[1] for w in workers]
    outputs, _ = results(run.run_dir)
    assert {o["id"]: tuple(o["token_ids"]) for o in outputs} == reference("pressure")

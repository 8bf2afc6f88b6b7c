"""The ranks of a ``restart_together`` actor fail and restart as one group (runtime/groups.py).

Each run launches fixture_actors.GROUP_OF_2 or GROUP_OF_3: a "worker" whose ranks restart
together, beside a "lane" of two ranks that restart alone. ``launching.launched`` reaps
every run and checks that none of its names is left.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

import pytest
from launching import QUICK, Launch, launched

from ringfence.shm import names

GROUP_SETS = (
    "actors.worker.backoff_s=0.1",
    "actors.worker.max_restarts=1",
    "actors.lane.backoff_s=0.1",
    "runtime.heartbeat_timeout_s=2.0",
    *QUICK,
)


def workers(ranks: int) -> list[str]:
    return [f"worker-{rank}" for rank in range(ranks)]


def pids(run: Launch) -> dict[str, int]:
    return {row["id"]: row["pid"] for row in run.actors()}


@dataclass
class GroupRun:
    launch: Launch
    ranks: int
    status: int
    before: dict[str, int]  # each instance's pid before worker-1 was killed
    after: dict[str, int]  # ... once every worker rank was ready again
    names_left: list[Any]


# Three ranks in the slow soak: the bookkeeping of any size is tested without processes.
@pytest.fixture(
    scope="module",
    params=[pytest.param(2, id="2-ranks"), pytest.param(3, id="3-ranks", marks=pytest.mark.slow)],
)
def group_run(request, tmp_path_factory):
    """A run whose worker-1 is SIGKILLed once every instance is ready; once every worker
    rank is ready again, lane-1 is SIGKILLed; once it is ready again, worker-0 is SIGKILLed:
    the group's second failure, past its max_restarts of 1, ends the run."""
    ranks = request.param
    tmp_path = tmp_path_factory.mktemp(f"group{ranks}")
    with launched(
        tmp_path, f"runtime.topology=fixture_actors:GROUP_OF_{ranks}", *GROUP_SETS
    ) as run:
        run.wait_ready()
        before = pids(run)
        run.kill_actor("worker-1")
        for instance in workers(ranks):
            run.wait_for_event("actor.ready", instance=instance, incarnation=2)
        after = pids(run)
        run.kill_actor("lane-1")
        run.wait_for_event("actor.ready", instance="lane-1", incarnation=2)
        run.kill_actor("worker-0")
        status = run.wait()
        yield GroupRun(run, ranks, status, before, after, names.list_names(run.run_id))


def test_killing_one_rank_respawns_every_rank_of_the_group_in_new_processes(group_run):
    run, group = group_run.launch, workers(group_run.ranks)
    assert group_run.status == 1, run.tail()
    old = {group_run.before[i] for i in group}
    new = {group_run.after[i] for i in group}
    assert len(new) == group_run.ranks and old.isdisjoint(new)
    for instance in group:
        spawns = run.events("actor.spawn", instance=instance)
        assert [(e["incarnation"], e["instance_pid"]) for e in spawns] == [
            (1, group_run.before[instance]),
            (2, group_run.after[instance]),
        ]
        row = run.actor(instance)
        assert (row["incarnation"], row["restarts"]) == (2, 1)
    assert group_run.names_left == []


def test_one_group_restart_is_logged_naming_the_failed_rank_and_its_killed_siblings(group_run):
    run, group = group_run.launch, workers(group_run.ranks)
    siblings = [i for i in group if i != "worker-1"]
    (restart,) = run.events("actor.group_restart")
    assert (restart["group"], restart["instance"], restart["restarts"]) == ("worker", "worker-1", 1)
    assert (restart["siblings"], restart["killed"], restart["backoff_s"]) == (
        siblings,
        siblings,
        0.1,
    )
    kills = run.events("actor.kill")
    assert [(e["instance"], e["instance_pid"], e["reason"]) for e in kills] == [
        (i, group_run.before[i], "group restart: worker-1 failed") for i in siblings
    ]


def test_the_sibling_exits_the_kill_caused_are_not_failures_of_their_own(group_run):
    run = group_run.launch
    assert [e["instance"] for e in run.events("actor.gave_up")] == ["worker-0"]  # the 2nd kill
    assert [e["instance"] for e in run.events("actor.restart")] == ["lane-1"]  # no worker
    for instance in workers(group_run.ranks):
        first = run.events("actor.exit", instance=instance)[0]
        assert (first["incarnation"], first["exitcode"], first["clean"]) == (
            1,
            -signal.SIGKILL,
            False,
        )


def test_the_group_bumps_the_epoch_once_and_every_rank_starts_under_it(group_run):
    run = group_run.launch
    (restart,) = run.events("actor.group_restart")
    assert restart["new_epoch"] == 1
    for instance in workers(group_run.ranks):
        starts = run.events("actor.start", log=instance)
        assert [(e["incarnation"], e["epoch"]) for e in starts] == [(1, 0), (2, 1)]
    (lane,) = run.events("actor.restart")
    assert lane["new_epoch"] == 2  # the lane's own restart, the next bump


def test_no_new_rank_is_spawned_before_every_old_rank_has_exited(group_run):
    run, group = group_run.launch, workers(group_run.ranks)
    lines = run.events()

    def at(event: str, **fields: Any) -> int:
        (index,) = [
            i
            for i, e in enumerate(lines)
            if e["event"] == event and all(e.get(k) == v for k, v in fields.items())
        ]
        return index

    last_exit = max(at("actor.exit", instance=i, incarnation=1) for i in group)
    first_spawn = min(at("actor.spawn", instance=i, incarnation=2) for i in group)
    assert at("actor.group_restart") < last_exit < first_spawn


def test_a_rank_of_an_actor_that_does_not_restart_together_restarts_alone(group_run):
    run = group_run.launch
    assert group_run.after["lane-0"] == group_run.before["lane-0"]
    assert [e["incarnation"] for e in run.events("actor.spawn", instance="lane-0")] == [1]
    assert [e["incarnation"] for e in run.events("actor.spawn", instance="lane-1")] == [1, 2]
    assert [(r["id"], r["restarts"]) for r in run.actors() if r["name"] == "lane"] == [
        ("lane-0", 0),
        ("lane-1", 1),
    ]
    assert len(run.events("actor.group_restart")) == 1  # the worker's, not the lane's


def test_the_groups_max_restarts_counts_group_restarts_and_then_ends_the_run(group_run):
    run = group_run.launch
    (gave_up,) = run.events("actor.gave_up")
    assert (gave_up["instance"], gave_up["restarts"]) == ("worker-0", 1)
    (end,) = run.events("run.end")
    assert (end["reason"], end["exit_code"]) == ("worker-0 failed", 1)
    assert run.stderr() == "ringfence launch: worker-0 was killed by SIGKILL\n"
    assert [(r["id"], r["state"]) for r in run.actors() if r["name"] == "worker"] == [
        ("worker-0", "failed"),
        *((f"worker-{rank}", "stopped") for rank in range(1, group_run.ranks)),
    ]

"""Restart groups' bookkeeping (runtime/groups.py), without processes: which actors restart
together, and when a group's ranks may spawn again. The supervisor's use of it, with real
processes, is in test_supervisor_groups.py."""

from __future__ import annotations

import math

import pytest

from ringfence.runtime.groups import KILL_REAP_S, Groups
from ringfence.runtime.manifest import InstanceEntry
from ringfence.runtime.run import Slot
from ringfence.runtime.topology import ActorSpec, Topology

IDLE = "fixture_actors:Idle"


def topology(ranks: int = 3) -> Topology:
    return Topology(
        actors=(
            ActorSpec(name="worker", target=IDLE, ranks=ranks, restart_together=True),
            ActorSpec(name="lane", target=IDLE, ranks=2),
        )
    )


def slots_of(topo: Topology, placement: str = "spawn") -> list[Slot]:
    """One slot per instance, each "ready" with a running process (a stand-in object)."""
    slots = []
    for index, (name, rank) in enumerate(topo.instances()):
        entry = InstanceEntry(
            id=f"{name}-{rank}",
            name=name,
            rank=rank,
            index=index,
            target=IDLE,
            placement=placement,
            bell=f"/bell.{name}.{rank}",
            inboxes=(),
            outboxes=(),
        )
        slot = Slot(entry=entry, control=None, writer=None)  # type: ignore[arg-type]
        slot.proc, slot.state, slot.incarnation = object(), "ready", 1
        slots.append(slot)
    return slots


def by_id(slots: list[Slot]) -> dict[str, Slot]:
    return {s.entry.id: s for s in slots}


def test_only_spawned_ranks_of_a_restart_together_actor_of_several_ranks_are_a_group():
    spawned = by_id(slots_of(topology()))
    groups = Groups(topology())
    assert [i for i, s in spawned.items() if groups.together(s)] == [
        "worker-0",
        "worker-1",
        "worker-2",
    ]
    external = by_id(slots_of(topology(), placement="external"))
    assert not groups.together(external["worker-0"])  # not ours to kill: each rank alone
    one = Groups(topology(ranks=1))
    assert not one.together(by_id(slots_of(topology(ranks=1)))["worker-0"])


def test_an_optional_actor_cannot_restart_together():
    with pytest.raises(ValueError, match="actor c: an optional actor cannot restart_together"):
        Topology(
            actors=(ActorSpec(name="c", target=IDLE, attach="optional", restart_together=True),)
        )


def test_a_failed_rank_marks_every_rank_restarting_and_names_the_siblings_to_kill():
    slots = slots_of(topology())
    ranks = by_id(slots)
    failed = ranks["worker-1"]
    failed.proc = None
    groups = Groups(topology())
    running = groups.begin(slots, failed, backoff=0.5, now=100.0)
    assert [s.entry.id for s in running] == ["worker-0", "worker-2"]
    assert [(s.state, s.restarts, s.deadline) for s in slots[:3]] == [
        ("restarting", 1, math.inf)
    ] * 3
    assert [(s.state, s.restarts) for s in slots[3:]] == [("ready", 0)] * 2  # the lane
    assert list(groups.wakes(slots)) == [100.0 + KILL_REAP_S]  # old ranks left


def test_a_group_spawns_only_once_every_old_rank_has_exited_and_the_backoff_has_passed():
    slots = slots_of(topology())
    ranks = by_id(slots)
    ranks["worker-0"].proc = None
    ranks["worker-2"].incarnation = 2  # a rank that was restarted alone before, say
    groups = Groups(topology())
    groups.begin(slots, ranks["worker-0"], backoff=0.5, now=100.0)
    assert groups.due(slots, 100.0) == ([], [])  # old ranks left
    ranks["worker-1"].proc = None
    assert groups.due(slots, 100.1) == ([], [])  # worker-2's process is still left
    ranks["worker-2"].proc = None
    assert list(groups.wakes(slots)) == [100.5]
    assert groups.due(slots, 100.4) == ([], [])  # in the backoff
    ready, stuck = groups.due(slots, 100.5)
    assert ([[s.entry.id for s in group] for group in ready], stuck) == (
        [["worker-0", "worker-1", "worker-2"]],
        [],
    )
    assert [s.incarnation for s in slots[:3]] == [2, 2, 2]  # each spawn makes it 3
    assert (list(groups.wakes(slots)), groups.due(slots, 101.0)) == ([], ([], []))


def test_a_killed_rank_still_alive_at_the_reap_deadline_is_reported_stuck():
    slots = slots_of(topology(ranks=2))
    ranks = by_id(slots)
    ranks["worker-1"].proc = None
    groups = Groups(topology(ranks=2))
    groups.begin(slots, ranks["worker-1"], backoff=0.0, now=100.0)
    ready, stuck = groups.due(slots, 100.0 + KILL_REAP_S)
    assert (ready, [s.entry.id for s in stuck]) == ([], ["worker-0"])

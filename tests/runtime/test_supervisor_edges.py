"""The supervisor's edges: a stop cut short, the stop deadline, restart backoff, ranks, cleaning.

Each test runs ``ringfence launch`` as a subprocess with the demo pipeline or a
topology from fixture_actors.py; ``launching.launched`` reaps every run and checks
that none of its names is left.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fixture_actors
import pytest
from launching import QUICK, Launch, launched, matches, ringfence, wait_gone

from ringfence.actors.tools.testing.demo import SENT
from ringfence.shm import names
from ringfence.shm.counter import CounterBlock

# A streaming run whose sink blocks in on_stop: only a SIGKILL ends its stop.
SLOW_STOP = (
    "runtime.topology=fixture_actors:SLOW_STOP_SINK",
    "demo.messages=0",
    "runtime.heartbeat_s=0.1",
)


def order_of(lines: list[dict[str, Any]], *wanted: tuple[str, dict[str, Any]]) -> list[int]:
    """Position of the first line of each (event, fields) in ``lines``; AssertionError if none."""
    found = []
    for event, fields in wanted:
        at = [i for i, line in enumerate(lines) if matches(line, event, fields)]
        assert at, f"no {event} {fields} in {[line['event'] for line in lines]}"
        found.append(at[0])
    return found


def name_set(run_id: str) -> set[str]:
    return {e.name for e in names.list_names(run_id)}


def every_name(run: Launch) -> set[str]:
    """The names a live run holds: those of its manifest, and its lease."""
    return {*run.manifest().names, f"/rf-{run.run_id}-lease"}


@contextmanager
def counter_block(run: Launch, name: str) -> Iterator[CounterBlock]:
    """Counter block ``name`` of a run, attached until the block exits (readable after the run)."""
    (entry,) = [c for c in run.manifest().counters if c.name == name]
    block = CounterBlock.attach(entry.posix)
    try:
        yield block
    finally:
        block.close()


# Stopping.


@dataclass
class CutStop:
    launch: Launch
    status: int
    took_s: float  # from the first signal to the supervisor's exit
    children_left: list[int]
    names_left: set[str]


@pytest.fixture(scope="module")
def cut_stop(tmp_path_factory):
    """A run stopped by SIGTERM whose stop, blocked in the sink's on_stop, a SIGINT cuts short."""
    tmp_path = tmp_path_factory.mktemp("cut")
    with launched(tmp_path, *SLOW_STOP, "runtime.stop_timeout_s=30.0") as run:
        run.wait_ready()
        children = run.child_stamps()
        assert len(children) == 3
        sent_at = time.monotonic()
        run.send_signal(signal.SIGTERM)
        run.wait_for_event("actor.exit", instance="relay-0")  # the sink's Stop is next
        run.send_signal(signal.SIGINT)
        status = run.wait()
        took = time.monotonic() - sent_at
        alive = [c.pid for c in children if c.is_alive()]
        yield CutStop(run, status, took, alive, name_set(run.run_id))


def test_a_second_signal_during_the_stop_kills_what_is_left_at_once(cut_stop):
    run = cut_stop.launch
    assert cut_stop.status == 143, run.tail()
    assert cut_stop.took_s < 15.0  # the stop deadline is 30 s away
    assert (cut_stop.children_left, cut_stop.names_left) == ([], set())
    assert [(e["signal"], e.get("during")) for e in run.events("run.signal")] == [
        ("SIGTERM", None),
        ("SIGINT", "stop"),
    ]
    assert [
        (e["instance"], e["exitcode"], e["clean"])
        for e in run.events("actor.exit")
        if e["instance"] != "sink-0"
    ] == [("source-0", 0, True), ("relay-0", 0, True)]
    assert {e["instance"] for e in run.events("actor.kill")} == {"sink-0"}
    lines = run.events()
    order = order_of(
        lines,
        ("run.stop", {"stop_timeout_s": 30.0}),
        ("run.signal", {"during": "stop"}),
        ("actor.kill", {"instance": "sink-0"}),
        ("run.end", {"reason": "signal SIGTERM", "exit_code": 143}),
    )
    assert order == sorted(order)


def test_the_kill_after_a_second_signal_does_not_claim_the_stop_deadline_passed(cut_stop):
    kill = cut_stop.launch.events("actor.kill", instance="sink-0")[0]
    assert kill["reason"] != "stop deadline passed"


def test_an_actor_killed_in_the_stop_is_logged_as_exited_and_listed_as_stopped(cut_stop):
    run = cut_stop.launch
    exits = run.events("actor.exit", instance="sink-0")
    assert [(e["exitcode"], e["clean"]) for e in exits] == [(-signal.SIGKILL, False)]
    row = run.actor("sink-0")
    assert (row["state"], row["exitcode"]) == ("stopped", -signal.SIGKILL)


def test_an_actor_that_does_not_stop_in_time_is_killed_at_the_stop_deadline(tmp_path):
    stop_timeout_s = 1.0
    with launched(tmp_path, *SLOW_STOP, f"runtime.stop_timeout_s={stop_timeout_s}") as run:
        run.wait_ready()
        children = run.child_stamps()
        run.send_signal(signal.SIGTERM)
        assert run.wait() == 143, run.tail()
        assert [c.pid for c in children if c.is_alive()] == []
        assert name_set(run.run_id) == set()

        (stop,) = run.events("run.stop")
        kill = run.events("actor.kill")[0]
        assert (kill["instance"], kill["reason"]) == ("sink-0", "stop deadline passed")
        waited_s = (kill["mono_ns"] - stop["mono_ns"]) / 1e9
        assert stop_timeout_s <= waited_s < stop_timeout_s + 5.0
        assert [(e["instance"], e["clean"]) for e in run.events("actor.exit")][:2] == [
            ("source-0", True),
            ("relay-0", True),
        ]
        assert [e.get("during") for e in run.events("run.signal")] == [None]
        (end,) = run.events("run.end")
        assert (end["reason"], end["exit_code"]) == ("signal SIGTERM", 143)


# Restarts.


def test_the_restart_backoff_doubles_up_to_backoff_max_s_and_each_restart_bumps_the_epoch(
    tmp_path,
):
    sets = (
        "demo.messages=0",
        "actors.relay.backoff_s=0.2",
        "actors.relay.backoff_max_s=0.3",
        "actors.relay.max_restarts=3",
        "runtime.heartbeat_timeout_s=2.0",
        *QUICK,
    )
    with launched(tmp_path, *sets) as run:
        run.wait_ready()
        for incarnation in (2, 3, 4):
            run.kill_actor("relay-0")
            run.wait_for_event("actor.ready", instance="relay-0", incarnation=incarnation)
        run.send_signal(signal.SIGTERM)
        assert run.wait() == 143, run.tail()

        restarts = run.events("actor.restart")
        assert [
            (e["instance"], e["restarts"], e["backoff_s"], e["new_epoch"]) for e in restarts
        ] == [("relay-0", 1, 0.2, 1), ("relay-0", 2, 0.3, 2), ("relay-0", 3, 0.3, 3)]
        respawns = run.events("actor.spawn", instance="relay-0")[1:]
        assert [e["incarnation"] for e in respawns] == [2, 3, 4]
        for restart, spawn in zip(restarts, respawns, strict=True):
            assert spawn["mono_ns"] - restart["mono_ns"] >= restart["backoff_s"] * 1e9
        assert [e["epoch"] for e in run.events("actor.start", log="relay-0")] == [0, 1, 2, 3]
        row = run.actor("relay-0")
        assert (row["incarnation"], row["restarts"], row["state"]) == (4, 3, "stopped")
        assert run.events("actor.gave_up") == []


# Ranks.


def test_a_relay_of_two_ranks_has_a_ring_per_pair_of_instances_and_delivers_every_item(
    tmp_path,
):
    total = 10_000
    sets = ("runtime.topology=fixture_actors:RANKED", f"demo.messages={total}", *QUICK)
    with launched(tmp_path, *sets) as run:
        run.wait_for_event("run.start")
        manifest = run.manifest()
        with run.demo_counters() as demo, counter_block(run, "ranks") as ranks:
            assert run.wait() == 0, run.tail()
            sent = demo[SENT].value()
            forwarded = [ranks[i].value() for i in fixture_actors.FORWARDED_BY]
            applied = [ranks[i].value() for i in fixture_actors.APPLIED_FROM]
        assert (sent, forwarded, applied) == (total, [total - 1, total], [total // 2] * 2)
        assert name_set(run.run_id) == set()

        assert [(e.id, [ep.peer for ep in e.inboxes]) for e in manifest.instances] == [
            ("source-0", ["supervisor-0"]),
            ("relay-0", ["supervisor-0", "source-0"]),
            ("relay-1", ["supervisor-0", "source-0"]),
            ("sink-0", ["supervisor-0", "relay-0", "relay-1"]),
        ]
        assert [(e.id, ep.peer, ep.ring) for e in manifest.instances for ep in e.outboxes] == [
            ("source-0", "relay-0", f"/rf-{run.run_id}-ring.source.0.relay.0"),
            ("source-0", "relay-1", f"/rf-{run.run_id}-ring.source.0.relay.1"),
            ("relay-0", "sink-0", f"/rf-{run.run_id}-ring.relay.0.sink.0"),
            ("relay-1", "sink-0", f"/rf-{run.run_id}-ring.relay.1.sink.0"),
        ]
        assert [(a["id"], a["state"], a["exitcode"]) for a in run.actors()] == [
            (instance, "stopped", 0) for instance in ("source-0", "relay-0", "relay-1", "sink-0")
        ]
        (end,) = run.events("run.end")
        assert (end["reason"], end["exit_code"]) == ("shutdown requested by sink-0", 0)
        assert run.events("actor.failed", log="sink-0") == []


# Cleaning and run dirs.


@pytest.mark.serial
def test_clean_all_removes_a_killed_runs_names_and_leaves_a_live_run_alone(tmp_path):
    killed_sets = ("demo.messages=0", "runtime.heartbeat_timeout_s=2.0", *QUICK)
    live_sets = ("runtime.topology=fixture_actors:GATED_SINK", "demo.messages=0", *QUICK)
    with (
        launched(tmp_path, *killed_sets, run_dir=tmp_path / "killed") as killed,
        launched(tmp_path, *live_sets, run_dir=tmp_path / "live") as live,
    ):
        killed.wait_ready()
        live.wait_ready()
        children = killed.child_stamps()
        killed.send_signal(signal.SIGKILL)
        assert killed.wait() == -signal.SIGKILL
        wait_gone(children, timeout=10.0)
        killed_names, live_names = every_name(killed), every_name(live)
        assert (name_set(killed.run_id), name_set(live.run_id)) == (killed_names, live_names)

        cleaned = ringfence("clean", "--all")
        assert cleaned.returncode == 0, cleaned.stderr
        out = cleaned.stdout.splitlines()
        removed = [line.removeprefix("removed ") for line in out if line.startswith("removed ")]
        assert killed_names <= set(removed)  # other dead runs on this machine may go too
        assert live_names.isdisjoint(removed)
        assert f"kept run {live.run_id}: its creator is alive (--force removes it)" in out
        assert out[-1] == f"{len(removed)} names removed"
        assert (name_set(killed.run_id), name_set(live.run_id)) == (set(), live_names)

        assert live.proc.poll() is None
        (live.run_dir / fixture_actors.FINISH_FILE).touch()
        assert live.wait() == 0, live.tail()
        (end,) = live.events("run.end")
        assert (end["reason"], end["exit_code"]) == ("shutdown requested by sink-0", 0)
        assert name_set(live.run_id) == set()


@dataclass
class Refused:
    status: int
    stderr: str
    names_left: set[str]


def launch_into(tmp_path: Path, run_dir: Path) -> Refused:
    with launched(tmp_path, "demo.messages=10", *QUICK, run_dir=run_dir) as run:
        status = run.wait()
        return Refused(status, run.stderr(), name_set(run.run_id))


def test_a_run_dir_that_is_a_regular_file_creates_no_names_and_keeps_the_file(tmp_path):
    run_dir = tmp_path / "a-file"
    run_dir.write_text("not a run dir\n")
    refused = launch_into(tmp_path, run_dir)
    assert refused.status != 0
    assert refused.names_left == set()
    assert run_dir.read_text() == "not a run dir\n"


def test_a_run_dir_that_is_a_regular_file_is_a_one_line_error_naming_it(tmp_path):
    run_dir = tmp_path / "a-file"
    run_dir.write_text("not a run dir\n")
    refused = launch_into(tmp_path, run_dir)
    assert refused.status == 2
    assert refused.stderr.startswith("ringfence launch: ") and refused.stderr.count("\n") == 1
    assert str(run_dir) in refused.stderr

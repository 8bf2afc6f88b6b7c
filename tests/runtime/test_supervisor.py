"""``ringfence launch`` end to end: each test runs the supervisor as a subprocess it reaps.

The runs use the demo pipeline (source -> relay -> sink) or a fixture topology from
fixture_actors.py, and follow the supervisor through its log and the demo counters.
Every launched run is reaped and its names checked by ``launching.launched``.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any

import fixture_actors
import pytest
from launching import DEMO_TOPOLOGY, QUICK, Launch, launched, ringfence, wait_gone

from ringfence.actors.tools.testing.demo import (
    APPLIED,
    BATCH,
    FORWARDED,
    RELAY_REPEATS,
    SENT,
    SINK_REPEATS,
)
from ringfence.runtime.config import load_config
from ringfence.shm import names

DEMO_INSTANCES = ["source-0", "relay-0", "sink-0"]
# A send waits for room up to half the heartbeat timeout: 2 s is longer than a restart,
# and short enough that an actor blocked on a dead peer soon reads its Stop.
SHORT_SENDS = "runtime.heartbeat_timeout_s=4.0"
# The complete run's stream: more items than the demo's two rings hold (1 MiB each, about
# 8,700 items of 64 bytes), so they wrap several times. The items are most of its CPU.
TOTAL = 40_000


def story(run: Launch, instance: str) -> list[tuple[str, int | None]]:
    """(event, incarnation) of every supervisor line about ``instance``, in order."""
    return [(e["event"], e.get("incarnation")) for e in run.events(instance=instance)]


def first_index(lines: list[dict[str, Any]], event: str, **fields: Any) -> int:
    """Position of the first line of ``event`` with ``fields``; AssertionError if none."""
    found = [
        i
        for i, e in enumerate(lines)
        if e["event"] == event and all(e.get(k) == v for k, v in fields.items())
    ]
    assert found, f"no {event} {fields} in {[e['event'] for e in lines]}"
    return found[0]


# A complete run.


def test_the_demo_pipeline_delivers_every_item_under_the_supervisor_and_exits_0(tmp_path):
    sets = (f"demo.messages={TOTAL}", *QUICK)
    with launched(tmp_path, *sets) as run:
        run.wait_for_event("run.start")
        with run.demo_counters() as demo:
            assert run.wait() == 0, run.tail()
            counts = [demo[i].value() for i in (SENT, FORWARDED, APPLIED)]
            repeats = [demo[i].value() for i in (SINK_REPEATS, RELAY_REPEATS)]
        assert counts == [TOTAL, TOTAL, TOTAL]
        assert repeats == [0, 0]
        assert names.list_names(run.run_id) == []

        (done,) = run.events("demo.done", log="sink-0")
        assert (done["messages"], done["received"], done["repeats"]) == (TOTAL, TOTAL, 0)
        (end,) = run.events("run.end")
        assert (end["reason"], end["exit_code"]) == ("shutdown requested by sink-0", 0)
        assert [
            (a["id"], a["state"], a["exitcode"], a["incarnation"], a["restarts"])
            for a in run.actors()
        ] == [(instance, "stopped", 0, 1, 0) for instance in DEMO_INSTANCES]
        (start,) = run.events("run.start")
        assert (start["run_id"], start["run_dir"], start["instances"]) == (
            run.run_id,
            str(run.run_dir),
            DEMO_INSTANCES,
        )
        resolved = load_config(None, [f"runtime.topology={DEMO_TOPOLOGY}", *sets])
        assert load_config(run.run_dir / "config.toml") == resolved
        assert run.stdout().splitlines() == [
            f"ringfence launch: run {run.run_id} in {run.run_dir}",
            f"ringfence launch: run {run.run_id} ended (shutdown requested by sink-0), "
            "exit status 0",
        ]


# Restarts.


def kill_mid_stream_and_go_on(run: Launch, victim: str, at: int) -> None:
    """Kill ``victim`` once the sink has applied ``at`` items of an endless stream, see the
    restarted pipeline carry the items sent after the kill, then stop the run by SIGTERM.

    The stream is endless so that the victim cannot be done before it dies, however slowly
    this process is scheduled (a stream of 40,000 items once finished before the kill came).
    The sink raises on a gap, so every item up to the last it applied arrived exactly once.
    """
    run.wait_ready()
    run.wait_for_heartbeats(victim, 3)
    with run.demo_counters() as demo:
        run.wait_for_counter(demo, APPLIED, at)
        pid = run.kill_actor(victim)
        sent = demo[SENT].value()  # at least every item sent before the kill
        run.wait_for_event("actor.ready", instance=victim, incarnation=2)
        run.wait_for_counter(demo, APPLIED, sent + 2 * BATCH)
        run.send_signal(signal.SIGTERM)
        assert run.wait() == 143, run.tail()
    killed = run.events("actor.exit", instance=victim)[0]
    assert (killed["incarnation"], killed["instance_pid"], killed["exitcode"], killed["clean"]) == (
        1,
        pid,
        -signal.SIGKILL,
        False,
    )


@pytest.mark.parametrize("victim", ["relay", "sink", "source"])
def test_an_actor_killed_mid_stream_is_restarted_and_every_item_arrives_once(tmp_path, victim):
    instance = f"{victim}-0"
    sets = (
        "demo.messages=0",
        f"actors.{victim}.backoff_s=0.1",
        f"actors.{victim}.max_restarts=1",
        SHORT_SENDS,
        *QUICK,
    )
    with launched(tmp_path, *sets) as run:
        kill_mid_stream_and_go_on(run, instance, at=5_000)

        assert story(run, instance) == [
            ("actor.spawn", 1),
            ("actor.ready", 1),
            ("actor.exit", 1),
            ("actor.restart", None),
            ("actor.spawn", 2),
            ("actor.ready", 2),
            ("actor.exit", 2),
        ]
        row = run.actor(instance)
        assert (row["incarnation"], row["restarts"], row["state"]) == (2, 1, "stopped")
        assert run.events("actor.failed", log="sink-0") == []  # a gap would fail the sink


@pytest.mark.slow
def test_a_long_stream_survives_a_kill_of_every_actor_in_turn(tmp_path):
    total = 1_000_000
    backoffs = [f"actors.{name}.backoff_s=0.1" for name in ("source", "relay", "sink")]
    with launched(tmp_path, f"demo.messages={total}", *backoffs, *QUICK) as run:
        run.wait_ready()
        with run.demo_counters() as demo:
            for k, instance in enumerate(DEMO_INSTANCES, start=1):
                run.wait_for_counter(demo, APPLIED, k * 200_000)
                run.kill_actor(instance)
                run.wait_for_event("actor.ready", instance=instance, incarnation=2)
            assert run.wait(120) == 0, run.tail()
            assert demo[APPLIED].value() == total
        assert [a["restarts"] for a in run.actors()] == [1, 1, 1]


def test_with_restart_never_a_killed_relay_ends_the_run_with_status_1(tmp_path):
    sets = ("demo.messages=0", "actors.relay.restart=never", "runtime.heartbeat_timeout_s=2.0")
    with launched(tmp_path, *sets, *QUICK) as run:
        run.wait_ready()
        with run.demo_counters() as demo:
            run.wait_streaming(demo)
        run.kill_actor("relay-0")
        assert run.wait() == 1, run.tail()

        (gave_up,) = run.events("actor.gave_up")
        assert (gave_up["instance"], gave_up["restarts"], gave_up["restart"]) == (
            "relay-0",
            0,
            "never",
        )
        assert run.events("actor.restart") == []
        (end,) = run.events("run.end")
        assert (end["reason"], end["exit_code"]) == ("relay-0 failed", 1)
        row = run.actor("relay-0")
        assert (row["state"], row["restarts"], row["exitcode"]) == ("failed", 0, -signal.SIGKILL)
        # Killed, it left no failure record: the terminal says how it ended.
        assert run.stderr() == "ringfence launch: relay-0 was killed by SIGKILL\n"


def test_with_max_restarts_1_the_second_kill_of_the_relay_ends_the_run(tmp_path):
    sets = (
        "demo.messages=0",
        "actors.relay.max_restarts=1",
        "actors.relay.backoff_s=0.1",
        SHORT_SENDS,
    )
    with launched(tmp_path, *sets, *QUICK) as run:
        run.wait_ready()
        with run.demo_counters() as demo:
            run.wait_streaming(demo, above=20_000)
            run.wait_for_heartbeats("relay-0", 3)
            first = run.kill_actor("relay-0")
            run.wait_for_event("actor.ready", instance="relay-0", incarnation=2)
            run.wait_for_counter(demo, FORWARDED, demo[FORWARDED].value() + 1000)  # serving
            second = run.kill_actor("relay-0")
            assert run.wait() == 1, run.tail()

        (gave_up,) = run.events("actor.gave_up")
        assert (gave_up["instance"], gave_up["restarts"]) == ("relay-0", 1)
        assert [
            (e["incarnation"], e["instance_pid"], e["exitcode"])
            for e in run.events("actor.exit", instance="relay-0")
        ] == [(1, first, -signal.SIGKILL), (2, second, -signal.SIGKILL)]


HUNG_TIMEOUT_S = 1.0


@dataclass
class HungRun:
    launch: Launch
    status: int
    applied: int
    sink_repeats: int


@pytest.fixture(scope="module")
def hung_run(tmp_path_factory):
    """One completed run whose sink hangs in a handler in its first incarnation."""
    tmp_path = tmp_path_factory.mktemp("hung")
    sets = (
        "runtime.topology=fixture_actors:HUNG_SINK",
        "demo.messages=2000",  # all of them fit in the rings: nobody upstream blocks
        "runtime.heartbeat_s=0.1",
        f"runtime.heartbeat_timeout_s={HUNG_TIMEOUT_S}",
        "runtime.stop_timeout_s=5.0",
        "actors.sink.backoff_s=0.1",
    )
    with launched(tmp_path, *sets) as run:
        run.wait_for_event("run.start")
        with run.demo_counters() as demo:
            status = run.wait()
            applied, repeats = demo[APPLIED].value(), demo[SINK_REPEATS].value()
        assert names.list_names(run.run_id) == []
        yield HungRun(run, status, applied, repeats)


def test_a_hung_actor_is_killed_after_the_heartbeat_timeout_and_restarted(hung_run):
    run = hung_run.launch
    assert hung_run.status == 0, run.tail()
    assert (hung_run.applied, hung_run.sink_repeats) == (2000, 0)  # the hung item, redelivered
    lines = run.events(instance="sink-0")
    order = [
        first_index(lines, "actor.ready", incarnation=1),
        first_index(lines, "actor.hung"),
        first_index(lines, "actor.kill", reason="heartbeat stale"),
        first_index(lines, "actor.exit", incarnation=1, exitcode=-signal.SIGKILL),
        first_index(lines, "actor.restart", restarts=1),
        first_index(lines, "actor.spawn", incarnation=2),
        first_index(lines, "actor.ready", incarnation=2),
    ]
    assert order == sorted(order)
    hung = lines[order[1]]
    assert HUNG_TIMEOUT_S <= hung["heartbeat_age_s"] < HUNG_TIMEOUT_S + 1.0
    assert run.events("actor.hung", instance="source-0") == []
    assert run.events("actor.hung", instance="relay-0") == []
    (done,) = run.events("demo.done", log="sink-0")
    assert done["messages"] == 2000
    row = run.actor("sink-0")
    assert (row["incarnation"], row["restarts"], row["state"]) == (2, 1, "stopped")


def test_a_hung_actor_is_reported_and_killed_once(hung_run):
    run = hung_run.launch
    assert len(run.events("actor.hung")) == 1
    assert len(run.events("actor.kill")) == 1


def test_a_sink_stalled_past_the_send_timeout_loses_no_items(tmp_path):
    # 20000 items do not fit in the relay -> sink ring, so the relay blocks on the hung sink.
    sets = (
        "runtime.topology=fixture_actors:HUNG_SINK",
        "demo.messages=20000",
        "runtime.heartbeat_s=0.25",
        "runtime.heartbeat_timeout_s=1.0",
        "actors.sink.backoff_s=0.1",
        "actors.relay.backoff_s=0.1",
        "runtime.stop_timeout_s=5.0",
    )
    with launched(tmp_path, *sets) as run:
        run.wait_for_event("run.start")
        with run.demo_counters() as demo:
            status = run.wait()
            applied = demo[APPLIED].value()
        assert (status, applied) == (0, 20000), run.tail()
        assert run.events("msg.failed", log="relay-0") == []
        assert run.events("msg.deferred", log="relay-0") != []  # it did wait on the sink


# Signals.


@pytest.mark.parametrize(
    ("signum", "status"),
    [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_signal_to_the_supervisor_stops_an_endless_stream_in_topology_order(
    tmp_path, signum, status
):
    stop_timeout_s = 5.0
    with launched(tmp_path, "demo.messages=0", *QUICK) as run:
        run.wait_ready()
        with run.demo_counters() as demo:
            run.wait_streaming(demo)
        children = run.child_stamps()
        assert len(children) == 3
        sent_at = time.monotonic()
        run.send_signal(signum)
        assert run.wait() == status, run.tail()
        assert time.monotonic() - sent_at < stop_timeout_s
        assert [c.pid for c in children if c.is_alive()] == []
        assert names.list_names(run.run_id) == []  # before any `ringfence clean`

        name = signal.Signals(signum).name
        assert [
            (e["event"], e.get("instance"))
            for e in run.events()
            if e["event"].startswith("run.") or e["event"] in ("actor.exit", "actor.kill")
        ] == [
            ("run.start", None),
            ("run.signal", None),
            ("run.stop", None),
            ("actor.exit", "source-0"),
            ("actor.exit", "relay-0"),
            ("actor.exit", "sink-0"),
            ("run.end", None),
        ]
        assert [(e["exitcode"], e["clean"]) for e in run.events("actor.exit")] == [(0, True)] * 3
        (end,) = run.events("run.end")
        assert (end["reason"], end["exit_code"]) == (f"signal {name}", status)


def test_actors_exit_by_themselves_when_the_supervisor_is_killed_and_clean_removes_the_rest(
    tmp_path,
):
    with launched(tmp_path, "demo.messages=0", "runtime.heartbeat_timeout_s=2.0", *QUICK) as run:
        run.wait_ready()
        with run.demo_counters() as demo:
            run.wait_streaming(demo)
        children = run.child_stamps()
        assert len(children) == 3
        run.send_signal(signal.SIGKILL)
        assert run.wait() == -signal.SIGKILL
        wait_gone(children, timeout=10.0)
        # Each one closed by itself. The sink, which never waits on a peer, saw the loss at
        # its next heartbeat; the others may first fail a send to a peer that already left.
        for instance in DEMO_INSTANCES:
            assert len(run.events("actor.stop", log=instance)) == 1, instance
        (stop,) = run.events("actor.stop", log="sink-0")
        assert (stop["reason"], stop["error"]) == ("supervisor lost", None)
        assert len(run.events("supervisor.lost", log="sink-0")) == 1

        left = names.list_names(run.run_id)
        manifest = run.manifest()
        assert {e.name for e in left} == {*manifest.names, f"/rf-{run.run_id}-lease"}
        cleaned = ringfence("clean", run.run_dir)
        assert cleaned.returncode == 0, cleaned.stderr
        assert cleaned.stdout.splitlines() == [
            *(f"removed {e.name}" for e in left),
            f"{len(left)} names removed",
        ]
        assert names.list_names(run.run_id) == []


def test_a_launch_in_the_run_dir_of_a_killed_run_removes_its_stale_names_first(tmp_path):
    with launched(tmp_path, "demo.messages=0", "runtime.heartbeat_timeout_s=2.0", *QUICK) as dead:
        dead.wait_ready()
        children = dead.child_stamps()
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        wait_gone(children, timeout=10.0)
        stale = dead.run_id
        assert names.list_names(stale) != []

        with launched(tmp_path, "demo.messages=1000", *QUICK, run_dir=dead.run_dir) as run:
            assert run.wait() == 0, run.tail()
            assert run.run_id != stale
            assert [e["run_id"] for e in run.events("run.clean")] == [stale]
            assert names.list_names(stale) == []
            assert names.list_names(run.run_id) == []
            assert run.manifest().run_id == run.run_id


def test_a_second_launch_in_the_run_dir_of_a_live_run_is_refused(tmp_path):
    with launched(tmp_path, "demo.messages=0", *QUICK) as live:
        live.wait_ready()
        with launched(tmp_path, "demo.messages=0", *QUICK, run_dir=live.run_dir) as second:
            assert second.wait() == 2
            assert second.stderr() == (
                f"ringfence launch: run dir {live.run_dir} belongs to live run {live.run_id}\n"
            )
            assert names.list_names(second.run_id) == []
        assert live.proc.poll() is None
        assert live.manifest().run_id == live.run_id
        live.send_signal(signal.SIGTERM)
        assert live.wait() == 143


# Failures before and at start.


BAD_LAUNCHES = [
    pytest.param(
        ["runtime.spinus=5"],
        None,
        ["--set runtime.spinus", "(did you mean runtime.spin_us?)"],
        id="misspelt-key",
    ),
    pytest.param(
        ["actors.relya.restart=never"],
        None,
        ["actors.relya", "unknown actor (did you mean actors.relay?)"],
        id="unknown-actor",
    ),
    pytest.param(
        ["runtime.heartbeat_s=fast"],
        None,
        ["--set runtime.heartbeat_s", "expected a number, got str 'fast'"],
        id="wrong-type",
    ),
    pytest.param(
        [],
        "[runtime]\nspin_us = = 5\n",
        ["{config}: invalid TOML"],
        id="toml-syntax-error",
    ),
    pytest.param(
        ["runtime.topology=no_such_module:TOPOLOGY"],
        None,
        ["cannot import 'no_such_module' for 'no_such_module:TOPOLOGY'"],
        id="missing-topology",
    ),
]


@pytest.mark.parametrize(("sets", "toml", "said"), BAD_LAUNCHES)
def test_a_bad_config_is_a_named_error_and_creates_nothing(tmp_path, sets, toml, said):
    config = None
    if toml is not None:
        config = tmp_path / "bad.toml"
        config.write_text(toml)
    with launched(tmp_path, *sets, config=config) as run:
        assert run.wait() == 2
        stderr = run.stderr()
        assert stderr.startswith("ringfence launch: ") and stderr.count("\n") == 1, stderr
        for text in said:
            assert text.format(config=config) in stderr
        assert run.stdout() == ""  # no run was announced, so no run id was ever issued
        assert not run.run_dir.exists()
        leases = [names.read_lease(rid) for rid in {e.run_id for e in names.list_names()}]
        assert [s for s in leases if s is not None and s.pid == run.proc.pid] == []


def test_an_actor_that_fails_in_on_start_with_restart_never_ends_the_run_with_status_1(tmp_path):
    sets = (
        "runtime.topology=fixture_actors:FAILING_START",
        "actors.relay.restart=never",
        "demo.messages=1000",
    )
    started = time.monotonic()
    with launched(tmp_path, *sets, *QUICK) as run:
        assert run.wait() == 1, run.tail()
        assert time.monotonic() - started < 10.0

        (failed,) = run.events("actor.failed", log="relay-0")
        assert failed["where"] == "on_start"
        refused = fixture_actors.StartRefused("fixture relay refuses to start")
        assert failed["error"] == repr(refused)
        assert "fixture_actors.py" in failed["exception"]
        assert story(run, "relay-0") == [
            ("actor.spawn", 1),
            ("actor.exit", 1),
            ("actor.gave_up", None),
        ]
        (exited,) = run.events("actor.exit", instance="relay-0")
        assert (exited["exitcode"], exited["clean"]) == (1, False)
        (end,) = run.events("run.end")
        assert (end["reason"], end["exit_code"]) == ("relay-0 failed", 1)
        assert names.list_names(run.run_id) == []

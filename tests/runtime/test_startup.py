"""A run that cannot start says why, at once: the topology's preflight refuses it before
anything exists; an actor that fails before it was ever ready ends the launch without a
restart; and the terminal shows the actor, its error and the line that raised it.

The runs are the demo pipeline with a fixture preflight or a fixture relay
(fixture_actors.py); every launch is reaped and its names checked by ``launched``.
"""

from __future__ import annotations

import re
import signal
import time

from launching import QUICK, launched

from ringfence.shm import names

START_FAILURE = re.compile(
    r"^ringfence launch: relay-0 failed in on_start: StartRefused: fixture relay refuses to "
    r"start\n  at \S*fixture_actors\.py:\d+ in on_start\n$"
)


def test_a_run_its_preflight_refuses_exits_2_naming_the_file_and_field_and_creates_nothing(
    tmp_path,
):
    started = time.monotonic()
    with launched(tmp_path, "runtime.topology=fixture_actors:REFUSED", *QUICK) as run:
        assert run.wait() == 2
        elapsed = time.monotonic() - started
        said = "ringfence launch: /fixture/settings.json: answer: must be 42, got 41\n"
        assert run.stderr() == said
        assert run.stdout() == ""  # no run announced: no run id was ever issued
        assert not run.run_dir.exists()  # no log, no manifest, no actors.json: nothing spawned
        leases = [names.read_lease(rid) for rid in {e.run_id for e in names.list_names()}]
        assert [s for s in leases if s is not None and s.pid == run.proc.pid] == []
    assert elapsed < 10.0, f"the refusal took {elapsed:.1f}s"


def test_an_actor_that_fails_in_on_start_before_it_was_ready_ends_the_launch_without_a_restart(
    tmp_path,
):
    sets = ("runtime.topology=fixture_actors:FAILING_START", "demo.messages=1000", *QUICK)
    with launched(tmp_path, *sets) as run:  # the default policy: on-failure, 3 restarts
        assert run.wait() == 1, run.tail()

        assert run.events("actor.restart") == []
        assert [e["event"] for e in run.events(instance="relay-0")] == [
            "actor.spawn",
            "actor.exit",
            "actor.gave_up",
        ]
        (exited,) = run.events("actor.exit", instance="relay-0")
        assert exited["where"] == "on_start"
        assert exited["error"] == "StartRefused: fixture relay refuses to start"
        assert exited["at"].endswith(" in on_start") and "fixture_actors.py:" in exited["at"]
        (gave_up,) = run.events("actor.gave_up")
        assert (gave_up["restarts"], gave_up["ever_ready"]) == (0, False)
        assert START_FAILURE.match(run.stderr()), run.stderr()
        assert run.stdout().endswith("ended (relay-0 failed), exit status 1\n")


def test_an_actor_that_was_ready_once_is_restarted_even_past_a_restart_that_fails_in_on_start(
    tmp_path,
):
    sets = (
        "runtime.topology=fixture_actors:FAILING_RESTART",
        "demo.messages=0",
        "actors.relay.backoff_s=0.1",
        *QUICK,
    )
    with launched(tmp_path, *sets) as run:
        run.wait_ready()
        run.kill_actor("relay-0")
        run.wait_for_event("actor.ready", instance="relay-0", incarnation=3)
        run.send_signal(signal.SIGTERM)
        assert run.wait() == 143, run.tail()

        assert [e["restarts"] for e in run.events("actor.restart")] == [1, 2]
        failed = run.events("actor.exit", instance="relay-0", incarnation=2)
        assert [(e["where"], e["clean"]) for e in failed] == [("on_start", False)]
        assert run.events("actor.gave_up") == []
        assert run.stderr() == ""  # the run was not failed: nothing to explain


def test_an_actor_that_declares_a_section_the_run_lacks_fails_its_start_naming_it(tmp_path):
    sets = ("runtime.topology=fixture_actors:UNKNOWN_SECTION", "demo.messages=10", *QUICK)
    with launched(tmp_path, *sets) as run:
        assert run.wait() == 1, run.tail()

        assert run.events("actor.restart") == []
        (exited,) = run.events("actor.exit", instance="relay-0")
        assert exited["where"] == "attach"
        assert exited["error"] == (
            "ConfigError: actor fixture_actors:MisspeltRelay: MisspeltSettings.dmeo: the run's "
            "config has no section 'dmeo' (did you mean demo?)"
        )
        assert run.stdout().endswith("ended (relay-0 failed), exit status 1\n")

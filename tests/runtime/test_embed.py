"""Embedding an actor of a launched run: scripts/embed_example, and attach() in this process.

Each run places the demo sink ``external``: the supervisor creates its rings and waits
for a host process to attach it by the run dir.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from launching import EMBED_EXAMPLE, QUICK, Launch, launch_env, launched

from ringfence.actors.tools.testing.demo import APPLIED, BATCH, SENT
from ringfence.actors.tools.testing.shm import reap_subprocess
from ringfence.runtime.driver import Driver
from ringfence.runtime.embed import attach
from ringfence.shm import names
from ringfence.shm.errors import EndpointTaken

EXTERNAL_SINK = "actors.sink.placement=external"
POLL_TIMEOUT_S = 0.05
HOST_TIMEOUT_S = 60.0


def embed_example(run: Launch, mode: str) -> list[str]:
    """The command line of scripts/embed_example attaching the sink of ``run``."""
    return [
        sys.executable,
        str(EMBED_EXAMPLE),
        str(run.run_dir),
        "--mode",
        mode,
        "--timeout",
        str(HOST_TIMEOUT_S),
    ]


@contextmanager
def hosted(run: Launch, mode: str) -> Iterator[subprocess.Popen[str]]:
    """scripts/embed_example running in the background; SIGKILLed (by pid) if still there."""
    host = subprocess.Popen(
        embed_example(run, mode),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=launch_env(run.mark),
    )
    try:
        yield host
    finally:
        reap_subprocess(host, HOST_TIMEOUT_S)


def poll_until(driver: Driver, done, timeout: float = HOST_TIMEOUT_S) -> int:
    """Drive ``driver`` from this thread until ``done()`` or it stops; how many polls it took."""
    deadline = time.monotonic() + timeout
    polls = 0
    while not done() and driver.stop_reason is None:
        assert time.monotonic() < deadline, f"driver still running after {timeout}s"
        driver.poll(POLL_TIMEOUT_S)  # blocks on the actor's doorbell, not a sleep
        polls += 1
    return polls


@pytest.mark.parametrize("mode", ["run", "thread", "poll"])
def test_the_embed_example_applies_every_item_as_the_external_sink(tmp_path, mode):
    with launched(tmp_path, EXTERNAL_SINK, "demo.messages=30000", *QUICK) as run:
        run.wait_for_event("actor.await", instance="sink-0", incarnation=1)
        host = subprocess.run(
            embed_example(run, mode),
            capture_output=True,
            text=True,
            timeout=HOST_TIMEOUT_S + 30,
            env=launch_env(run.mark),
            check=False,
        )
        assert host.returncode == 0, host.stderr
        lines = host.stdout.splitlines()
        assert lines[0] == "embedded sink-0 (incarnation 1) attached"
        assert "embedded sink-0 applied 30000 items" in lines
        assert lines[-1] == "stopped: shutdown requested by sink-0; 30000 items applied"
        if mode == "poll":
            assert re.fullmatch(r"host loop polled \d+ times", lines[-2])
        assert run.wait() == 0, run.tail()
        assert names.list_names(run.run_id) == []
        (ready,) = run.events("actor.ready", instance="sink-0")
        assert (ready["incarnation"], ready["instance_pid"]) == (1, host_pid_of(run))


def host_pid_of(run: Launch) -> int:
    """The pid that wrote the embedded sink's log (the host process)."""
    (start,) = run.events("actor.start", log="sink-0")
    return int(start["pid"])


def test_the_run_fails_when_no_external_actor_attaches_within_the_ready_timeout(tmp_path):
    sets = (EXTERNAL_SINK, "runtime.ready_timeout_s=1.0", "demo.messages=1000")
    with launched(tmp_path, *sets, *QUICK) as run:
        assert run.wait() == 1, run.tail()
        (waiting,) = run.events("actor.await", instance="sink-0")
        (late,) = run.events("actor.late", instance="sink-0")
        assert (late["ready_timeout_s"], late["instance_pid"]) == (1.0, None)
        # The deadline is set just before the await line is written (a few microseconds: a
        # fresh-clone run saw the late line 999.99 ms after it), so a millisecond of slack.
        assert late["mono_ns"] - waiting["mono_ns"] >= 1_000_000_000 - 1_000_000
        (end,) = run.events("run.end")
        assert (end["reason"], end["exit_code"]) == ("sink-0 did not attach within 1.0s", 1)
        assert run.actor("sink-0")["state"] == "failed"
        assert names.list_names(run.run_id) == []


def test_attaching_an_instance_another_process_holds_raises_endpoint_taken(tmp_path):
    with launched(tmp_path, EXTERNAL_SINK, "demo.messages=0", *QUICK) as run:
        run.wait_for_event("actor.await", instance="sink-0")
        with hosted(run, "poll") as host, run.demo_counters() as demo:
            ready = run.wait_for_event("actor.ready", instance="sink-0")
            assert ready["instance_pid"] == host.pid
            with pytest.raises(EndpointTaken, match=f"already open in live process {host.pid}"):
                attach(run.run_dir, "sink")
            # The refused attach took nothing from the holder: it keeps applying items.
            run.wait_streaming(demo, above=demo[APPLIED].value() + 1000)

            run.send_signal(signal.SIGTERM)
            out, err = host.communicate(timeout=HOST_TIMEOUT_S)
            assert host.returncode == 0, err
            assert out.splitlines()[-1].startswith("stopped: signal SIGTERM; ")
            assert run.wait() == 143, run.tail()
        assert names.list_names(run.run_id) == []


def test_a_sink_attached_and_polled_in_the_test_process_completes_the_run(tmp_path):
    with launched(tmp_path, EXTERNAL_SINK, "demo.messages=5000", *QUICK) as run:
        run.wait_for_event("actor.await", instance="sink-0")
        with run.demo_counters() as demo:
            driver = attach(run.run_dir, "sink")
            try:
                polls = poll_until(driver, lambda: False)
            finally:
                driver.close()
            assert driver.error is None
            assert driver.stop_reason == "shutdown requested by sink-0"
            assert polls > 0
            assert demo[APPLIED].value() == 5000
        assert run.wait() == 0, run.tail()
        (ready,) = run.events("actor.ready", instance="sink-0")
        assert (ready["incarnation"], ready["instance_pid"]) == (1, os.getpid())
        (done,) = run.events("demo.done", log="sink-0")
        assert (done["messages"], done["repeats"]) == (5000, 0)
        assert names.list_names(run.run_id) == []


def test_an_external_sink_whose_host_died_can_be_attached_again_and_carries_the_stream_on(
    tmp_path,
):
    # An endless stream, stopped by SIGTERM once the second host has applied what was sent
    # after the first one died: a stream of 60,000 items could end before the kill came,
    # however briefly this process was descheduled.
    sets = (
        EXTERNAL_SINK,
        "demo.messages=0",
        # Nothing tells the supervisor that an external host died: it finds out when it
        # next checks heartbeats, within runtime.heartbeat_timeout_s.
        "runtime.heartbeat_timeout_s=2.0",
    )
    with launched(tmp_path, *sets, *QUICK) as run:
        run.wait_for_event("actor.await", instance="sink-0")
        with hosted(run, "poll") as host, run.demo_counters() as demo:
            run.wait_for_event("actor.ready", instance="sink-0", incarnation=1)
            run.wait_streaming(demo, above=2000)
            run.wait_for_heartbeats("sink-0", 3)
            os.kill(host.pid, signal.SIGKILL)
            host.wait(HOST_TIMEOUT_S)
            detach = run.wait_for_event("actor.detach", instance="sink-0")
            assert detach["clean"] is False
            run.wait_for_event("actor.await", instance="sink-0", incarnation=2)
            sent = demo[SENT].value()  # the source went on until the rings were full

            driver = attach(run.run_dir, "sink")
            try:
                poll_until(driver, lambda: demo[APPLIED].value() > sent + 2 * BATCH)
                assert driver.stop_reason is None
                run.send_signal(signal.SIGTERM)
                poll_until(driver, lambda: False)  # until the supervisor's Stop
            finally:
                driver.close()
            assert driver.error is None
        assert run.wait() == 143, run.tail()
        (ready,) = run.events("actor.ready", instance="sink-0", incarnation=2)
        assert ready["instance_pid"] == os.getpid()
        # The sink raises on a gap: every item it applied arrived exactly once.
        assert run.events("actor.failed", log="sink-0") == []


def test_attaching_an_instance_twice_in_one_process_raises_endpoint_taken(tmp_path):
    with launched(tmp_path, EXTERNAL_SINK, "demo.messages=0", *QUICK) as run:
        run.wait_ready("source-0", "relay-0")
        first = attach(run.run_dir, "sink")
        try:
            first.poll(POLL_TIMEOUT_S)
            with pytest.raises(EndpointTaken, match="already open in this process"):
                second = attach(run.run_dir, "sink")
                second.close()  # only reached when the second attach was let through
            first.actor.request_shutdown("test: done")
            poll_until(first, lambda: False)
        finally:
            first.close()
        assert first.error is None
        assert run.wait() == 0, run.tail()


def test_attach_to_a_folder_that_is_not_a_run_dir_is_a_value_error_naming_names_json(tmp_path):
    with pytest.raises(
        ValueError, match=re.escape(f"{tmp_path / 'names.json'}: no names manifest")
    ):
        attach(tmp_path, "sink")

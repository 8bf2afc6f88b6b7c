"""Hosted actors (runtime/hosting.py): the demo sink on a thread of the relay's process.

Each launched run places ``sink`` hosted by ``relay``: the supervisor spawns the source and
the relay, and the relay's process attaches the sink beside its own actor. The process is
one; the instances, their rings, logs and incarnations stay two.
"""

from __future__ import annotations

import signal
from dataclasses import replace

import fixture_actors
import orjson
import pytest
from launching import DEMO_TOPOLOGY, QUICK, Launch, launched

from ringfence.actors.tools.testing.demo import APPLIED, BATCH, SENT, SINK_REPEATS, TOPOLOGY
from ringfence.runtime.config import RunConfig
from ringfence.runtime.hosting import check_hosts, hosts_of
from ringfence.runtime.topology import ActorSpec
from ringfence.shm import names
from ringfence.shm.errors import ConfigError

HOSTED_SINK = ("actors.sink.placement=hosted", "actors.sink.host=relay")
# A send waits for room up to half the heartbeat timeout: short enough that the source,
# blocked on a relay that is gone, soon reads its Stop; long enough for a restart.
SHORT_SENDS = "runtime.heartbeat_timeout_s=4.0"


def story(run: Launch, instance: str) -> list[tuple[str, int | None]]:
    """(event, incarnation) of every supervisor line about ``instance``, in order."""
    return [(e["event"], e.get("incarnation")) for e in run.events(instance=instance)]


def pid_of_start(run: Launch, instance: str, incarnation: int) -> int:
    """The pid that logged ``instance``'s start of ``incarnation``."""
    (start,) = run.events("actor.start", log=instance, incarnation=incarnation)
    return int(start["pid"])


def test_a_hosted_sink_runs_on_its_hosts_process_and_the_run_delivers_every_item(tmp_path):
    total = 20_000
    with launched(tmp_path, f"demo.messages={total}", *HOSTED_SINK, *QUICK) as run:
        run.wait_for_event("run.start")
        with run.demo_counters() as demo:
            assert run.wait() == 0, run.tail()
            assert (demo[APPLIED].value(), demo[SINK_REPEATS].value()) == (total, 0)
        assert names.list_names(run.run_id) == []
        relay, sink = run.actor("relay-0"), run.actor("sink-0")
        assert (sink["placement"], sink["state"], sink["incarnation"]) == ("hosted", "stopped", 1)
        assert sink["pid"] == relay["pid"] == pid_of_start(run, "sink-0", 1)
        (start,) = run.events("actor.start", log="sink-0")
        assert start["placement"] == "hosted"
        # The host stopped its guest before it left: the sink exited clean, in its own log.
        (stop,) = run.events("actor.stop", log="sink-0")
        assert stop["reason"] == "relay-0 stopped"
        (detach,) = run.events("actor.detach", instance="sink-0")
        assert detach["clean"] is True
        assert story(run, "sink-0") == [
            ("actor.await", 1),
            ("actor.ready", 1),
            ("actor.detach", None),
        ]
        names_file = orjson.loads((run.run_dir / "names.json").read_bytes())
        hosts = {i["id"]: i["host"] for i in names_file["instances"]}
        assert hosts == {"source-0": "", "relay-0": "", "sink-0": "relay-0"}


def test_a_kill_of_the_host_process_restarts_both_and_every_item_arrives_once(tmp_path):
    # An endless stream, stopped by SIGTERM once the restarted pair has carried what was sent
    # after the kill: a finite one could end before the kill came.
    sets = (
        "demo.messages=0",
        "actors.relay.backoff_s=0.1",
        "actors.relay.max_restarts=1",
        SHORT_SENDS,
        *HOSTED_SINK,
        *QUICK,
    )
    with launched(tmp_path, *sets) as run:
        run.wait_ready()
        with run.demo_counters() as demo:
            run.wait_for_counter(demo, APPLIED, 5_000)
            pid = run.kill_actor("sink-0")  # the sink's pid is its host's
            sent = demo[SENT].value()
            run.wait_for_event("actor.ready", instance="sink-0", incarnation=2)
            run.wait_for_counter(demo, APPLIED, sent + 2 * BATCH)
            run.send_signal(signal.SIGTERM)
            assert run.wait() == 143, run.tail()
        assert pid == pid_of_start(run, "relay-0", 1)
        (killed, *_) = run.events("actor.exit", instance="relay-0")
        assert (killed["incarnation"], killed["exitcode"]) == (1, -signal.SIGKILL)
        assert story(run, "sink-0") == [
            ("actor.await", 1),
            ("actor.ready", 1),
            ("actor.detach", None),
            ("actor.await", 2),
            ("actor.ready", 2),
            ("actor.detach", None),
        ]
        assert pid_of_start(run, "sink-0", 2) == pid_of_start(run, "relay-0", 2)
        assert run.events("actor.failed", log="sink-0") == []  # a gap would fail the sink


def test_a_hosted_sink_that_fails_is_restarted_alone_in_its_hosts_process(tmp_path):
    total = 20_000
    sets = (
        "runtime.topology=fixture_actors:BREAKING_SINK",
        f"demo.messages={total}",
        "actors.sink.backoff_s=0.1",
        SHORT_SENDS,
        *HOSTED_SINK,
        *QUICK,
    )
    with launched(tmp_path, *sets) as run:
        run.wait_ready()
        with run.demo_counters() as demo:
            run.wait_for_counter(demo, APPLIED, 2_000)
            (run.run_dir / fixture_actors.BREAK_FILE).touch()
            assert run.wait() == 0, run.tail()
            assert demo[APPLIED].value() == total  # each item once, across the restart
        # The host lived on: one incarnation, one process, no failure of its own.
        assert story(run, "relay-0") == [("actor.spawn", 1), ("actor.ready", 1), ("actor.exit", 1)]
        relay = pid_of_start(run, "relay-0", 1)
        assert pid_of_start(run, "sink-0", 1) == pid_of_start(run, "sink-0", 2) == relay
        assert not (run.run_dir / "failures" / "relay-0.1.json").exists()
        guest = orjson.loads((run.run_dir / "failures" / "sink-0.1.json").read_bytes())
        assert (guest["where"], guest["message"]) == ("loop", "fixture sink breaks as asked")
        (exited,) = run.events("actor.exit", instance="sink-0")
        assert (exited["incarnation"], exited["clean"], exited["where"]) == (1, False, "loop")
        assert exited["error"] == "SinkBroke: fixture sink breaks as asked"
        (restart,) = run.events("actor.restart", instance="sink-0")
        assert restart["restarts"] == 1
        assert story(run, "sink-0") == [
            ("actor.await", 1),
            ("actor.ready", 1),
            ("actor.exit", 1),
            ("actor.restart", None),
            ("actor.await", 2),
            ("actor.ready", 2),
            ("actor.detach", None),
        ]
        assert run.actor("sink-0")["restarts"] == 1


def test_a_hosted_sink_that_fails_with_no_restarts_left_ends_the_run_saying_why(tmp_path):
    sets = (
        "runtime.topology=fixture_actors:BREAKING_SINK",
        "demo.messages=0",
        "actors.sink.restart=never",
        SHORT_SENDS,
        *HOSTED_SINK,
        *QUICK,
    )
    with launched(tmp_path, *sets) as run:
        run.wait_ready()
        (run.run_dir / fixture_actors.BREAK_FILE).touch()
        assert run.wait() == 1, run.tail()
        (gave_up,) = run.events("actor.gave_up", instance="sink-0")
        assert gave_up["restarts"] == 0
        assert "sink-0 failed in loop: SinkBroke: fixture sink breaks as asked" in run.stderr()
        # The host was stopped, not failed: it stopped its guest's thread and left clean.
        (exited,) = run.events("actor.exit", instance="relay-0")
        assert (exited["exitcode"], exited["clean"]) == (0, True)
    assert names.list_names(run.run_id) == []


def test_a_hung_hosted_sink_gets_its_host_killed_and_both_restarted(tmp_path):
    sets = (
        "runtime.topology=fixture_actors:HUNG_SINK",
        "demo.messages=2000",
        "runtime.heartbeat_timeout_s=2.0",
        "actors.relay.backoff_s=0.1",
        *HOSTED_SINK,
        *QUICK,
    )
    with launched(tmp_path, *sets) as run:
        run.wait_for_event("run.start")
        with run.demo_counters() as demo:
            assert run.wait() == 0, run.tail()
            assert demo[APPLIED].value() == 2000
        (hung,) = run.events("actor.hung", instance="sink-0")
        (kill,) = run.events("actor.kill", instance="relay-0")
        assert kill["reason"] == "hosted sink-0's heartbeat stale"
        assert kill["instance_pid"] == hung["instance_pid"]
        assert run.actor("sink-0")["incarnation"] == 2


# The topology's check, in this process.


def config(**policies: dict[str, str]) -> RunConfig:
    sets = [f"runtime.topology={DEMO_TOPOLOGY}"]
    sets += [f"actors.{name}.{k}={v}" for name, p in policies.items() for k, v in p.items()]
    return RunConfig.load(None, sets)


@pytest.mark.parametrize(
    ("policies", "key", "said"),
    [
        ({"sink": {"placement": "hosted"}}, "actors.sink.host", "needs a host"),
        ({"sink": {"placement": "hosted", "host": "worker"}}, "actors.sink.host", "no actor"),
        ({"sink": {"placement": "hosted", "host": "sink"}}, "actors.sink.host", "itself"),
        (
            {"sink": {"placement": "hosted", "host": "relay"}, "relay": {"placement": "external"}},
            "actors.sink.host",
            "must be spawned",
        ),
        (
            {"sink": {"placement": "hosted", "host": "relay"}, "relay": {"placement": "hosted"}},
            "actors.relay.host",
            "needs a host",
        ),
        ({"sink": {"host": "relay"}}, "actors.sink.host", "only with placement = 'hosted'"),
    ],
)
def test_a_host_that_cannot_run_its_guest_is_refused_naming_the_key(policies, key, said):
    with pytest.raises(ConfigError, match=said) as raised:
        check_hosts(config(**policies), TOPOLOGY)
    assert raised.value.key == key


def test_a_guest_with_other_ranks_than_its_host_is_refused():
    ranked = replace(
        TOPOLOGY,
        actors=tuple(
            ActorSpec(name=a.name, target=a.target, ranks=2) if a.name == "relay" else a
            for a in TOPOLOGY.actors
        ),
    )
    with pytest.raises(ConfigError, match="1 ranks and its host relay 2") as raised:
        check_hosts(config(sink={"placement": "hosted", "host": "relay"}), ranked)
    assert raised.value.key == "actors.sink.host"


def test_a_guest_whose_ranks_restart_together_is_refused():
    together = replace(
        TOPOLOGY,
        actors=tuple(
            replace(a, ranks=2, restart_together=True) if a.name == "sink" else replace(a, ranks=2)
            for a in TOPOLOGY.actors
        ),
    )
    with pytest.raises(ConfigError, match="restart together") as raised:
        check_hosts(config(sink={"placement": "hosted", "host": "relay"}), together)
    assert raised.value.key == "actors.sink.host"


def test_hosts_of_names_each_hosted_actors_host():
    cfg = config(sink={"placement": "hosted", "host": "relay"})
    check_hosts(cfg, TOPOLOGY)
    assert hosts_of(cfg, TOPOLOGY) == {"sink": "relay"}

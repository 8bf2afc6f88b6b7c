"""Optional actors (``ActorSpec.attach = "optional"``): slots the supervisor never spawns or awaits.

The runs launch fixture_clients:CLIENTS, whose ``client`` actor is optional.
"""

from __future__ import annotations

import signal

import pytest
from fixture_clients import CLIENTS
from launching import QUICK, launched

from ringfence.actors.client.client import CLIENT_SLOTS, Client, ClientError
from ringfence.runtime.manifest import build_manifest
from ringfence.runtime.topology import ActorSpec, Topology
from ringfence.shm import names

TOPOLOGY = "runtime.topology=fixture_clients:CLIENTS"
SLOTS = [f"client-{r}" for r in range(CLIENT_SLOTS)]


def test_attach_must_be_required_or_optional():
    spec = ActorSpec(name="x", target="m:X", attach="sometimes")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"actor x: attach must be one of \('required', 'optional'\)"
    ):
        Topology(actors=(spec,))


def test_an_optional_actor_is_placed_external_whatever_the_config_says():
    manifest = build_manifest(
        "run1",
        CLIENTS,
        placements={"client": "spawn", "engine": "spawn"},
        ring_bytes=4096,
        supervisor_pid=1,
        supervisor_start_ticks=0,
    )
    rows = {(e.id, e.placement, e.attach) for e in manifest.instances}
    assert rows == {(s, "external", "optional") for s in SLOTS} | {
        ("engine-0", "spawn", "required")
    }


def test_optional_slots_are_awaited_without_a_deadline_and_the_run_goes_on(tmp_path):
    # Long enough for the engine to start on a loaded machine, short beside the wait below.
    sets = (TOPOLOGY, "runtime.ready_timeout_s=2.0", *QUICK)
    with launched(tmp_path, *sets) as run:
        run.wait_ready("engine-0")
        for slot in SLOTS:
            run.wait_for_event("actor.await", instance=slot, incarnation=1)
        run.wait_for_heartbeats("engine-0", 60)  # 6 s: three ready timeouts
        assert run.events("actor.late") == []
        assert run.proc.poll() is None
        rows = {r["id"]: (r["placement"], r["attach"], r["state"]) for r in run.actors()}
        assert rows == {s: ("external", "optional", "starting") for s in SLOTS} | {
            "engine-0": ("spawn", "required", "ready")
        }
        run.send_signal(signal.SIGTERM)
        assert run.wait() == 143, run.tail()
        (end,) = run.events("run.end")
        assert end["reason"] == "signal SIGTERM"
        assert names.list_names(run.run_id) == []


def test_a_detached_slot_waits_for_the_next_attach(tmp_path):
    with launched(tmp_path, TOPOLOGY, *QUICK) as run:
        run.wait_ready("engine-0")
        with Client.connect(run.run_dir) as client:
            assert client.instance == "client-0"
            client.generate([1], max_tokens=1, timeout=30)
            run.wait_for_event("actor.ready", instance="client-0", incarnation=1)
        detach = run.wait_for_event("actor.detach", instance="client-0")
        assert detach["clean"] is True
        run.wait_for_event("actor.await", instance="client-0", incarnation=2)
        with Client.connect(run.run_dir) as client:
            client.generate([1], max_tokens=1, timeout=30)
            run.wait_for_event("actor.ready", instance="client-0", incarnation=2)
        run.send_signal(signal.SIGTERM)
        assert run.wait() == 143, run.tail()


def test_an_idle_client_only_warns_when_stale_and_does_not_hold_up_the_stop(tmp_path):
    sets = (TOPOLOGY, *QUICK, "runtime.heartbeat_timeout_s=0.5")
    with launched(tmp_path, *sets) as run:
        run.wait_ready("engine-0")
        with Client.connect(run.run_dir) as client:
            client.generate([1], max_tokens=1, timeout=30)
            hung = run.wait_for_event("actor.hung", instance="client-0")  # it stopped polling
            assert hung["heartbeat_age_s"] >= 0.5
            run.send_signal(signal.SIGTERM)
            assert run.wait() == 143, run.tail()
            assert run.events("actor.kill") == []
            (engine,) = run.events("actor.exit", instance="engine-0")
            assert engine["clean"] is True
            assert run.actor("client-0")["state"] == "stopped"
            # The client hears of the Stop the next time it waits.
            with pytest.raises(ClientError, match="client-0 stopped: signal SIGTERM"):
                client.generate([1], max_tokens=1, timeout=30)
        assert names.list_names(run.run_id) == []

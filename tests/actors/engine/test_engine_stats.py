"""The engine's Stats, every actor in this process (inproc.py): only clients that asked
get them, with zeros before the scheduler began and the run's figures after it; the
traced run still replays (the Stats are ring frames like any other)."""

from __future__ import annotations

import dataclasses
import time

import pytest
from engine_runs import TRACE, replayed
from inproc import inproc_run, wait_until_begun
from random_workloads import ENGINE, RUN_TIMEOUT_S, TIERS, write_workload

from ringfence.actors.client.client import Client, ClientError
from ringfence.actors.engine.intake import load_workload
from ringfence.actors.engine.stats import no_stats
from ringfence.actors.executors.worker import Worker
from ringfence.actors.protocol.client import Stats
from ringfence.actors.protocol.resync import Resync
from ringfence.runtime.actor import handles


def settled(client: Client) -> Stats:
    """The first Stats from now on of an engine with nothing running, waiting or in flight."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (remaining := deadline - time.monotonic()) > 0:
        stats = client.stats(timeout=remaining, fresh=True)
        idle = stats is not None and stats.running == stats.waiting == 0
        if idle and stats is not None and not any(stats.in_flight.values()):
            return stats
    raise TimeoutError(f"the engine did not settle within {RUN_TIMEOUT_S}s")


def test_after_a_run_under_pressure_the_stats_hold_the_engines_figures(tmp_path):
    workload = write_workload(tmp_path / "workload.jsonl", seed=5)
    with (
        inproc_run(tmp_path / "run", (*ENGINE, *TIERS, TRACE)) as run,
        Client.connect(run.run_dir, stats=True) as watcher,
        Client.connect(run.run_dir) as other,
    ):
        first = watcher.stats(timeout=RUN_TIMEOUT_S)  # sent right after the Hello
        assert first is not None and first.incarnation == watcher._actor.ctx.incarnation
        wait_until_begun(watcher, RUN_TIMEOUT_S)  # before, a Submit is refused as "starting"
        for line in load_workload(str(workload)):
            assert line.prompt_token_ids is not None
            watcher.submit(line.prompt_token_ids, request_id=line.id, max_tokens=8)
        for line in load_workload(str(workload)):
            watcher.result(line.id, timeout=RUN_TIMEOUT_S)
        stats = settled(watcher)
        engine = run.actor("engine-0")
        counters = engine.counters()
        # The one that did not ask: nothing came for it, and it cannot ask for them.
        assert len(other.generate([1, 2, 3], max_tokens=2, timeout=RUN_TIMEOUT_S).token_ids) == 2
        assert other._actor.stats is None and other._actor.dropped == 0
        with pytest.raises(ClientError, match="did not ask for stats"):
            other.stats()
    assert run.failures() == {}
    replayed(tmp_path / "run")
    assert stats.began and stats.incarnation == first.incarnation
    assert stats.preemptions == {"recompute": 0, "swap": counters["preemptions"]["swap"], "save": 0}
    assert stats.preemptions["swap"] > 0, counters  # the pool was too small: swap ran
    assert stats.steps == counters["steps"] == stats.ops["step"] > 0
    issued = counters["ops"]
    assert stats.ops["swap"] == issued["swap_out"] + issued["swap_in"] > 0
    assert stats.ops["store"] == issued.get("write_back", 0) + issued.get("prefetch", 0)
    assert stats.bytes == {
        name: counters["bytes"].get(name, 0)
        for name in ("swap_out", "swap_in", "store_write", "store_read")
    }
    assert stats.bytes["swap_out"] > 0 and stats.bytes["swap_in"] > 0
    assert stats.in_flight == {"step": 0, "swap": 0, "store": 0}
    assert stats.blocks_total == {"device": 16, "host": 24}
    assert stats.blocks_used["device"] == 0  # every request ended: cached blocks are free
    assert stats.hit_tokens == {
        tier: counters["hit_tokens"].get(tier, 0) for tier in ("device", "host", "storage")
    }


class SilentWorker(Worker):
    """A Worker that never answers the engine's Resync: the engine never begins."""

    @handles(Resync)
    def on_resync(self, msg: Resync) -> None:
        pass


def test_before_the_scheduler_began_the_stats_are_zeros_with_began_false(tmp_path):
    with (
        inproc_run(tmp_path / "run", ENGINE, classes={"worker": SilentWorker}) as run,
        Client.connect(run.run_dir, stats=True) as watcher,
    ):
        first = watcher.stats(timeout=RUN_TIMEOUT_S)
        ticked = watcher.stats(timeout=RUN_TIMEOUT_S, fresh=True)  # the next tick's
        assert run.actor("engine-0").scheduler is None
    expected = dataclasses.replace(no_stats(), incarnation=watcher._actor.ctx.incarnation)
    assert first is not None and ticked is not None and ticked is not first
    assert first == ticked == expected
    assert not first.began and set(first.preemptions) == {"recompute", "swap", "save"}

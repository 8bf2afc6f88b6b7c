"""Check ``declared`` of ``ringfence replay`` on real runs (every actor in this process,
inproc.py): the blocks each executor touched against the sets the scheduler declared
to the fence tracker.

``MUTANTS`` are mutants of the code, the way tests/modelcheck/configs.py names mutants of
the model: each changes only the sets the scheduler gives the tracker (the ops, and so
every executor's work, stay as they are), so the fences ignore some blocks. Each must be
named by the check on a real run whether or not the run hit a conflicting op; the code as
it is must pass the same run. (Every traced run of test_engine.py is replayed too, so
the check also runs on every preemption policy, on tp 2 and on Worker restarts there.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from inproc import inproc_run
from random_workloads import ENGINE, RUN_TIMEOUT_S, TIERS, write_workload

import ringfence.sched.blocks
from ringfence.actors.replay.checks import check_run
from ringfence.actors.replay.log import read_run
from ringfence.cache.fences import Fence, FenceTracker, Lane
from ringfence.cache.ids import Seq

Sets = dict[str, Any]


def _step_reads_nothing(lane: Lane, sets: Sets) -> Sets:
    """A step reports no reads (its writes only): the issue's example of an under-report."""
    return sets | {"read_device": ()} if lane is Lane.STEP else sets


def _swap_out_writes_no_host(lane: Lane, sets: Sets) -> Sets:
    """A swap-out reports no host write (the issue's other example)."""
    return sets | {"write_host": ()} if lane is Lane.SWAP and sets.get("read_device") else sets


def _swap_in_reads_one_host_block_less(lane: Lane, sets: Sets) -> Sets:
    """A swap-in leaves its last host block out of its reads."""
    host = sorted(sets.get("read_host") or ())
    return sets | {"read_host": host[:-1]} if lane is Lane.SWAP and host else sets


MUTANTS: dict[str, tuple[Callable[[Lane, Sets], Sets], str]] = {
    # name: (what it does to the sets of each op, the finding it must cause)
    "STEP_READS_NOTHING": (_step_reads_nothing, ": step "),
    "SWAP_OUT_WRITES_NO_HOST": (_swap_out_writes_no_host, "swap-out"),
    "SWAP_IN_READS_ONE_LESS": (_swap_in_reads_one_host_block_less, "swap-in"),
}


def mutant_tracker(mutate: Callable[[Lane, Sets], Sets]) -> type[FenceTracker]:
    class Mutant(FenceTracker):
        def issue(self, lane: Lane, seq: Seq, **sets: Any) -> Fence:
            return super().issue(lane, seq, **mutate(lane, sets))

    return Mutant


def traced_run(tmp_path, seed: int) -> Any:
    """The random workload of ``seed`` (swap preemption on a small device pool), traced, in
    process; the replay's result."""
    workload = write_workload(tmp_path / "workload.jsonl", seed=seed)
    sets = (*ENGINE, *TIERS, "runtime.log_level=trace", f"engine.workload={workload}")
    with inproc_run(tmp_path / "run", sets) as run:
        assert run.wait_shutdown(RUN_TIMEOUT_S), "the workload did not finish"
    return check_run(read_run(tmp_path / "run"))


def test_the_code_as_it_is_declares_every_block_its_executors_touch(tmp_path):
    result = traced_run(tmp_path, seed=21)
    assert [v for v in result.violations if v.check == "declared"] == []
    assert result.counts["declared ops"] > 20, result.counts
    assert result.counts["declared: ops without declared sets"] == 0


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_a_scheduler_that_under_reports_a_read_or_a_write_fails_on_a_real_run(
    tmp_path, monkeypatch, mutant
):
    mutate, names = MUTANTS[mutant]
    monkeypatch.setattr(ringfence.sched.blocks, "FenceTracker", mutant_tracker(mutate))
    result = traced_run(tmp_path, seed=21)
    found = [v.message for v in result.violations if v.check == "declared"]
    assert found, f"{mutant} passed check declared"
    assert any(names in message for message in found), found
    assert all("did not declare" in message for message in found), found

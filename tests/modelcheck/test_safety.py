"""The fence rule judged by safety on ops the real scheduler issued (modelcheck/safety.py):
every cross-lane pair that shares a block, one writing it, is ordered by the later op's
fence, under every preemption policy and on many seeds with pools small enough that the
rare ops (swap-ins, prefetches, write-backs) come often; each unsafe mutant of the code is
caught naming both ops; each safe change passes, a stronger rule reported as over-fencing.
Pure Python: no spin needed."""

from __future__ import annotations

from collections import Counter

import pytest

from modelcheck.safety import CODE_MUTANTS, over_fenced, unsafe_pairs
from modelcheck.tables import Preemption, RecordingTracker, Row, recording
from ringfence.cache.fences import Lane

SEEDS = range(60)
POLICIES: tuple[Preemption, ...] = ("swap", "save", "recompute")
POOLS = {"device_blocks": 8, "host_blocks": 8, "requests": 8}  # small: preemption is common


def kind(row: Row) -> str:
    if row.lane is Lane.STEP:
        return "step"
    if row.lane is Lane.SWAP:
        return "swap-in" if row.write_device else "swap-out"
    return "prefetch" if row.write_host else "write-back"


def run(seed: int, policy: Preemption, tracker: type[RecordingTracker] = RecordingTracker):
    return recording(seed, preemption=policy, tracker_class=tracker, **POOLS)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_fence_the_scheduler_issues_orders_every_conflicting_pair(policy: Preemption) -> None:
    kinds: Counter[str] = Counter()
    over = 0
    for seed in SEEDS:
        tracker = run(seed, policy)
        assert unsafe_pairs(tracker.rows, tracker.resets) == [], f"seed {seed}"
        kinds.update(kind(row) for row in tracker.rows)
        over += len(over_fenced(tracker.rows, tracker.resets))
    print(f"{policy}: {dict(kinds)}; fences above need (the monotone floor): {over}")
    rare = ("swap-in", "swap-out", "write-back") + (("prefetch",) if policy == "save" else ())
    assert all(kinds[k] >= 20 for k in rare), kinds  # the seeds reach the rare ops


@pytest.mark.parametrize("mutant", [m for m in CODE_MUTANTS if not m.safe], ids=lambda m: m.name)
def test_each_unsafe_mutant_of_the_code_is_caught_naming_both_ops(mutant) -> None:
    for seed in SEEDS:
        for policy in ("swap", "save"):
            tracker = run(seed, policy, mutant.tracker)
            found = unsafe_pairs(tracker.rows, tracker.resets)
            if found:
                print(f"{mutant.name}: seed {seed}, {policy}: {found[0]}")
                assert "touches a block it touches, one of them writing" in found[0]
                return
    pytest.fail(f"{mutant.name} survived {len(SEEDS)} seeds: {mutant.what}")


@pytest.mark.parametrize("mutant", [m for m in CODE_MUTANTS if m.safe], ids=lambda m: m.name)
def test_each_safe_change_passes_every_seed(mutant) -> None:
    for seed in SEEDS:
        for policy in POLICIES:
            tracker = run(seed, policy, mutant.tracker)
            assert unsafe_pairs(tracker.rows, tracker.resets) == [], (seed, policy)


def test_a_stronger_rule_shows_as_over_fencing_not_as_a_bug() -> None:
    (stronger,) = [m for m in CODE_MUTANTS if m.name == "WAIT_FOR_EVERYTHING"]
    ours = theirs = 0
    for seed in range(10):
        ours += len(over_fenced(run(seed, "save").rows))
        tracker = run(seed, "save", stronger.tracker)
        assert unsafe_pairs(tracker.rows) == []
        theirs += len(over_fenced(tracker.rows))
    assert theirs > ours > 0, (ours, theirs)

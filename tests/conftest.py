"""Fixtures shared by every test: the shared-memory leak guard, a seeded RNG, and one
launched engine run that several modules read."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from ringfence.actors.tools.testing.shm import leaked_names, shm_names
from ringfence.shm import names


@pytest.fixture(autouse=True)
def no_leaked_shm_names():
    """Fail any test that leaves a ringfence name in /dev/shm (and remove what it left)."""
    before = shm_names()
    yield
    leaked = leaked_names(before)
    for entry in leaked:
        names.unlink_name(entry)
    assert not leaked, f"test left shared-memory names behind: {[e.name for e in leaked]}"


@pytest.fixture
def rng(request) -> random.Random:
    """A random generator whose seed is printed, so a failing randomized run can be replayed."""
    seed = int(os.environ.get("RINGFENCE_TEST_SEED", random.randrange(1 << 32)))
    print(f"{request.node.nodeid}: seed {seed} (RINGFENCE_TEST_SEED={seed} replays it)")
    return random.Random(seed)


@pytest.fixture
def run_id() -> str:
    return names.new_run_id()


@pytest.fixture(scope="session")
def pressure_swap_run(tmp_path_factory) -> Path:
    """test_engine's CI run of ``pressure`` with swap preemption under chaos and poison
    (traced, finished, replayed and re-driven); test_replay_runs.py corrupts copies of its
    logs. One launch for both. Its run dir."""
    from engine_runs import TIERS, finished, workload_sets
    from launching import launched

    tmp = tmp_path_factory.mktemp("pressure-swap")
    with launched(tmp, *workload_sets("pressure", *TIERS, "sched.preemption=swap")) as run:
        finished(run)
    return run.run_dir

"""Fixtures shared by every test: the shared-memory leak guard, a seeded RNG, and one
launched engine run that several modules read; ``--typecheck`` (``tests/typecheck.py``)."""

from __future__ import annotations

import importlib.util
import os
import random
from pathlib import Path
from typing import Any

import pytest

from ringfence.actors.tools.testing.shm import leaked_names, shm_names
from ringfence.shm import names

pytest_plugins = ("typecheck",)  # --typecheck: mypy beside the session

if importlib.util.find_spec("xdist") is not None:  # the test extra has it

    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """``--dist loadfile`` with the files of ``tests/suite_order.py``'s ONE_UNIT folders
        each run as one unit on one worker: their package fixture (a served real model)
        then starts once, not once per file and worker."""
        if config.getoption("dist") != "loadfile":
            return None
        from suite_order import ONE_UNIT
        from xdist.scheduler import LoadFileScheduling  # type: ignore[import-untyped]

        class Scheduling(LoadFileScheduling):  # type: ignore[misc]
            def _split_scope(self, nodeid: str) -> str:
                for folder in ONE_UNIT:
                    if nodeid.startswith(folder):
                        return folder
                return str(super()._split_scope(nodeid))

        return Scheduling(config, log)


SERIAL_MARK = "mark.serial"  # scripts/test runs the serial tests of the files that say it


def unlisted_serial_files(items: list[pytest.Item]) -> list[str]:
    """The files of the serial tests in ``items`` that do not say ``SERIAL_MARK``."""
    files = {item.path for item in items if item.get_closest_marker("serial")}
    return sorted(str(path) for path in files if SERIAL_MARK not in path.read_text())


@pytest.hookimpl(tryfirst=True)  # before -m deselects them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Refuse a serial test that scripts/test's serial run would not collect; then collect
    the files of ``tests/suite_order.py`` first, in its order (a stable sort: the tests
    inside a file, and every other file, keep their order)."""
    if unlisted := unlisted_serial_files(items):
        raise pytest.UsageError(
            f"serial tests in files that do not say {SERIAL_MARK}, which scripts/test runs "
            f"them from: {unlisted}"
        )
    from suite_order import LONGEST_FIRST

    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath

    def key(item: pytest.Item) -> int:
        path = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else ""
        return rank.get(path, len(rank))

    items.sort(key=key)


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
    logs. One launch for both, whichever worker runs them (``tests/session_shared.py``).
    Its run dir."""
    from engine_runs import TIERS, finished, workload_sets
    from launching import launched
    from session_shared import built_once

    def launch(out: Path) -> None:
        with launched(out, *workload_sets("pressure", *TIERS, "sched.preemption=swap")) as run:
            finished(run)

    return built_once(tmp_path_factory, "pressure-swap", launch) / "run"

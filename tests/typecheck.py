"""``pytest --typecheck``: mypy beside the test session, its verdict in the session's summary.

``scripts/test`` runs the suite with it. The two type checks (the package, strictly, and the
tests) take about 60 and 85 s of one core each on a clean clone, where no mypy cache exists.
Run before the suite, they added about 85 s to the test command; but the suite leaves about
a seventh of its two cores idle (its launched runs wait on each other, on deadlines and on
children starting). So the controller starts both checks as the session begins, at the
lowest priority (``nice 19``), where they take what the tests leave idle and slow no test;
at the end it waits for them (with a deadline), prints each one's output in the summary,
and fails the session when either failed: the summary's last line then counts a
``typecheck failed``. Only the controller does this, never an xdist worker.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "actors", "shm", "cache", "sched")
# Both checks on a clean clone take about 85 s with a core each; behind a loaded suite at
# the lowest priority they may take the whole session, and then run alone.
WAIT_S = 900.0
FAILED = "typecheck failed"
_CHECKS = pytest.StashKey[list["Check"]]()
_SESSION = pytest.StashKey[pytest.Session]()


@dataclass
class Check:
    name: str
    proc: subprocess.Popen[bytes]
    output: Path


def _commands(python: Path) -> dict[str, list[str]]:
    mypy = [str(python), "-m", "mypy"]
    # mypy cannot follow setup.cfg's package_dir mapping, so it gets a link tree.
    tree = ROOT / "build" / "typecheck" / "ringfence"
    tree.mkdir(parents=True, exist_ok=True)
    for pkg in PACKAGES:
        link = tree / pkg
        if not link.is_symlink():
            link.symlink_to(Path("..", "..", "..", pkg))
    return {
        # The package, strictly (setup.cfg's [mypy]).
        "the package": [*mypy, "build/typecheck/ringfence"],
        # The tests, with untyped test functions allowed; their own cache, as their options
        # differ and so share no cached result with the package's.
        "the tests": [
            *mypy, "--cache-dir", ".mypy_cache/tests", "--allow-untyped-defs",
            "--allow-incomplete-defs", "--allow-untyped-calls", "--no-warn-return-any",
            "--no-warn-unused-ignores", "tests",
        ],
    }  # fmt: skip


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--typecheck",
        action="store_true",
        help="run mypy on the package and the tests beside the session, at the lowest "
        "priority; the session fails when either check does",
    )


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("--typecheck") or hasattr(config, "workerinput"):
        return
    folder = Path(tempfile.mkdtemp(prefix="ringfence-typecheck-"))
    checks = []
    for name, command in _commands(Path(sys.executable)).items():
        output = folder / name.replace(" ", "-")
        with output.open("wb") as out:
            proc = subprocess.Popen(
                ["nice", "-n", "19", *command], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
            )
        checks.append(Check(name, proc, output))
    config.stash[_CHECKS] = checks


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config.stash[_SESSION] = session


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config
) -> None:
    checks = config.stash.get(_CHECKS, None)
    if not checks:
        return
    terminalreporter.section("typecheck (mypy)")
    failed = []
    for check in checks:
        try:
            status = check.proc.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            check.proc.kill()
            check.proc.wait()
            status = None
        text = check.output.read_text(errors="replace").rstrip()
        verdict = "passed" if status == 0 else f"FAILED ({status=})"
        terminalreporter.write_line(f"mypy on {check.name}: {verdict}")
        if status != 0 or "Success" not in text:
            terminalreporter.write_line(text or "(no output)")
        if status != 0:
            failed.append(check.name)
    shutil.rmtree(checks[0].output.parent, ignore_errors=True)
    config.stash[_CHECKS] = []
    if failed:
        # Counted in the summary's last line, and the session's status made a failure.
        # As reports, which other plugins' summaries read (hypothesis: their __dict__).
        terminalreporter.stats.setdefault(FAILED, []).extend(
            SimpleNamespace(nodeid=f"mypy on {name}", when="typecheck") for name in failed
        )
        # The summary is written inside pytest_sessionfinish, after which pytest returns
        # the session's status.
        config.stash[_SESSION].exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_unconfigure(config: pytest.Config) -> None:
    """A session that ended before its summary (interrupted) ends the checks it started."""
    for check in config.stash.get(_CHECKS, None) or ():
        if check.proc.poll() is None:
            check.proc.kill()
            check.proc.wait()

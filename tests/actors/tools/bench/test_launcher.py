"""The benchmarks' launcher: a run that exits, a run that fails, a run that overruns.

The launched runs are the runtime's demo pipeline (source -> relay -> sink, no model):
``demo.messages=200`` ends by itself in a few seconds, ``demo.messages=0`` streams until
it is stopped. The conftest leak guard sees only run ids issued in the test process, not
a launched supervisor's, so these tests look for the run's names themselves.
"""

from __future__ import annotations

import contextlib
import os
import select
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from ringfence.actors.tools.bench import launcher
from ringfence.runtime.cli import run_id_of
from ringfence.shm import names

DEMO = "runtime.topology=ringfence.actors.tools.testing.demo:TOPOLOGY"
# An actor whose supervisor is gone stops itself at its next heartbeat: beats 30 s apart
# leave that to the launcher's kill of the process group, which the test is about.
SLOW_BEATS = ("runtime.heartbeat_s=30", "runtime.heartbeat_timeout_s=60")
EXIT_TIMEOUT_S = 60.0  # a whole demo run: start-up (each actor imports the runtime) and 200
# Long enough for the supervisor to spawn its actors (about 1 s on 2 idle CPUs), so
# that the kill lands on a whole pipeline.
OVERRUN_TIMEOUT_S = 6.0


@contextlib.contextmanager
def names_checked(run_dir: Path) -> Iterator[None]:
    """After the block: the run named its shared memory, and none of it is left."""
    yield
    run_id = run_id_of(str(run_dir))  # from names.json, which the supervisor writes first
    left = [e.name for e in names.list_names(run_id)]
    names.clean_run(run_id)  # not left for the next test, whatever happened
    assert (run_dir / "names.json").is_file() and left == []


def still_alive(pids: list[int], timeout: float) -> list[int]:
    """The processes of ``pids`` that have not exited within ``timeout`` seconds. They are
    not this process's children, so each is watched through a pidfd (readable once it has
    exited), with one deadline for all."""
    fds: dict[int, int] = {}
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # gone already
            fds[os.pidfd_open(pid)] = pid
    try:
        poller = select.poll()
        for fd in fds:
            poller.register(fd, select.POLLIN)
        waiting = set(fds)
        deadline = time.monotonic() + timeout
        while waiting and (left := deadline - time.monotonic()) > 0:
            for fd, _ in poller.poll(left * 1000):
                poller.unregister(fd)
                waiting.discard(fd)
        return sorted(fds[fd] for fd in waiting)
    finally:
        for fd in fds:
            os.close(fd)


def test_a_demo_run_exits_with_status_0_and_unlinks_its_names(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with names_checked(run_dir):
        done = launcher.run(
            run_dir, [DEMO, "demo.messages=200"], what="demo", timeout=EXIT_TIMEOUT_S
        )
    assert 0 < done.wall_s < EXIT_TIMEOUT_S
    assert done.tail.endswith("exit status 0")  # the supervisor's last line, from run.out
    assert (tmp_path / "run.out").read_text().endswith(done.tail + "\n")
    assert done.summary == {} and done.outputs == []  # the demo writes neither


def test_a_run_past_its_deadline_is_killed_with_its_process_group_and_names(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    with names_checked(run_dir), pytest.raises(launcher.RunError) as failed:
        launcher.run(
            run_dir,
            [DEMO, "demo.messages=0", *SLOW_BEATS],
            what="demo stream",
            timeout=OVERRUN_TIMEOUT_S,
        )
    assert str(failed.value) == f"demo stream killed after {OVERRUN_TIMEOUT_S:g} s"
    supervisor = orjson.loads((run_dir / "names.json").read_bytes())["supervisor_pid"]
    actors = [r["pid"] for r in orjson.loads((run_dir / "actors.json").read_bytes())]
    assert len(actors) == 3 and None not in actors, f"not every actor was up: {actors}"
    # SIGKILL is delivered, not awaited: the actors may take a moment to be gone.
    assert still_alive([supervisor, *actors], timeout=5.0) == []


def test_a_nonzero_exit_or_a_missing_summary_is_a_run_error_with_the_output_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "ringfence_command", lambda: ["false"])
    with pytest.raises(launcher.RunError, match=r"^failing exited with status 1:\n$"):
        launcher.run(tmp_path / "a" / "run", [], what="failing", timeout=EXIT_TIMEOUT_S)
    monkeypatch.setattr(launcher, "ringfence_command", lambda: ["echo", "said"])
    done = launcher.run(tmp_path / "b" / "run", ["x=1"], what="echo", timeout=EXIT_TIMEOUT_S)
    assert done.tail == f"said launch --run-dir {tmp_path / 'b' / 'run'} --set x=1"
    summary = r"^echo exited with status 0:\nsaid launch .* --workload synthetic:unique$"
    with pytest.raises(launcher.RunError, match=summary):
        launcher.run(
            tmp_path / "c" / "run",
            [],
            what="echo",
            timeout=EXIT_TIMEOUT_S,
            workload="synthetic:unique",
            needs_summary=True,
        )

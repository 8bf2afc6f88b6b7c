"""The supervisor's starter (runtime/starter.py): children forked from the server find the
actors' modules imported, a call raises here what it raised there, and the server and the
resource tracker end with the run, leaving no process behind."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
from launching import QUICK, launched, marked_pids

from ringfence.runtime.starter import Starter

# Imported by no runtime module: a child has it only from the server's preload (the server
# imports by the installed packages' path, not this process's: tests/ is not on it).
PRELOADED = "ringfence.actors.tools.bench.serving.sim_blocks"


def report_imported(send: Any) -> None:
    send.send(PRELOADED in sys.modules)
    send.close()


def refuse(what: str) -> None:
    raise ValueError(f"refused: {what}")


def leave(code: int) -> None:
    os._exit(code)


def wait_forever() -> None:
    import threading

    threading.Event().wait()


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


@pytest.mark.parametrize(("method", "imported"), [("forkserver", True), ("spawn", False)])
def test_a_child_of_the_fork_server_finds_the_modules_it_imported(method: str, imported: bool):
    starter = Starter(method, [PRELOADED])  # type: ignore[arg-type]
    try:
        assert starter.forks is (method == "forkserver")
        receive, send = starter._context.Pipe(duplex=False)
        proc = starter.process(report_imported, (send,), name="rf-test")
        proc.start()
        send.close()
        assert receive.poll(60)
        assert receive.recv() is imported
        proc.join(10)
        assert proc.exitcode == 0
    finally:
        starter.close()


def test_a_call_raises_here_what_the_child_raised_and_says_how_a_silent_one_ended():
    starter = Starter("forkserver")
    try:
        starter.call(len, ((),), timeout=60)  # no error: nothing raised
        with pytest.raises(ValueError, match="refused: the topology"):
            starter.call(refuse, ("the topology",), timeout=60)
        with pytest.raises(RuntimeError, match=r"leave ended with no answer \(exit code 3\)"):
            starter.call(leave, (3,), timeout=60)
        with pytest.raises(TimeoutError, match=r"wait_forever took more than 0\.5 s"):
            starter.call(wait_forever, (), timeout=0.5)
    finally:
        starter.close()


def test_close_ends_the_fork_server_and_the_tracker_and_reaps_them():
    from multiprocess import forkserver, resource_tracker

    starter = Starter("forkserver")
    starter.call(len, ((),), timeout=60)  # the server is up and has forked
    server = forkserver._forkserver._forkserver_pid
    tracker = resource_tracker._resource_tracker._pid
    assert server is not None and tracker is not None
    assert alive(server) and alive(tracker)
    starter.close()
    starter.close()  # idempotent
    assert not alive(server) and not alive(tracker)
    for pid in (server, tracker):  # reaped: no zombie left for this process to collect
        with pytest.raises(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def test_an_unknown_start_method_is_refused_by_name():
    with pytest.raises(ValueError, match=r"runtime\.start_method must be one of"):
        Starter("fork")  # type: ignore[arg-type]


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_a_launch_that_exited_left_no_process_of_its_own(tmp_path: Path, method: str):
    sets = ("demo.messages=1000", f"runtime.start_method={method}", *QUICK)
    with launched(tmp_path, *sets) as run:
        assert run.wait() == 0, run.tail()
        # The fork server and the tracker carried the launch's mark too: none is left.
        assert marked_pids(run.mark) == set()

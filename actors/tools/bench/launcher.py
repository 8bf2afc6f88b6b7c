"""The one way a benchmark runs ``ringfence launch``: start a run, wait for it, end it.

Contract:

* Each launch is a session of its own, so its supervisor leads a process group that
  holds every actor it spawns. The :class:`Launched` handle owns that group: its
  holder ends it with :meth:`Launched.close` (a ``with`` block does), and the launcher
  signals it only as a whole, by SIGKILL.
* Every wait has a deadline, fixed when the run starts: ``timeout`` seconds later.
* A run that overruns its deadline is killed by its process group and its
  shared-memory names are unlinked (a SIGKILLed supervisor unlinks nothing).
  :func:`run` does both; a :class:`Launched` holder that counts what a run left
  behind kills first (:meth:`Launched.wait`) and unlinks after (:meth:`Launched.clean`).

It imports no torch and none of the actors, so a benchmark's ``--help`` stays fast.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import orjson

from ringfence.runtime.cli import run_id_of
from ringfence.shm import names

TAIL_LINES = 10  # lines of a run's output that a RunError quotes
# A run whose deadline passed while its holder was busy still gets this one short wait,
# so a run that has just ended is not taken for one that overran.
LAST_WAIT_S = 0.1
REAP_S = 30.0  # a SIGKILLed supervisor is reaped within this (it cannot catch the signal)
SUMMARY, OUTPUTS = "summary.json", "outputs.jsonl"  # what a workload run writes at its end


class RunError(RuntimeError):
    """A launched run failed: it overran its deadline, exited with a nonzero status, or
    wrote no report. The message names the run and what failed."""


def ringfence_command() -> list[str]:
    """How a benchmark launches ``ringfence``: the console script beside this Python."""
    script = Path(sys.executable).with_name("ringfence")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "ringfence.runtime.cli"]


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a launch's own process group (the supervisor and its actors), then reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(REAP_S)


class Launched:
    """One ``ringfence launch`` into ``run_dir``, started in its own session, with a deadline.

    ``workload`` is the ``--workload`` to run (none: the topology brings its own work),
    ``settings`` the ``--set KEY=VALUE`` overrides in order, ``env`` variables added to
    this process's environment. The run's output (stdout and stderr) goes to
    ``<run_dir>.out`` beside the run dir, and it runs in the run dir's parent, which is
    created if missing.
    """

    __slots__ = ("deadline", "out_path", "proc", "run_dir", "started", "timeout")

    def __init__(
        self,
        run_dir: Path,
        settings: Sequence[str],
        *,
        timeout: float,
        workload: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        args = [*ringfence_command(), "launch", "--run-dir", str(run_dir)]
        if workload is not None:
            args += ["--workload", workload]
        for setting in settings:
            args += ["--set", setting]
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.out_path = run_dir.with_name(f"{run_dir.name}.out")
        self.timeout = timeout
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        with self.out_path.open("wb") as out:
            # A session of its own: one killpg ends the supervisor and every actor.
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=None if env is None else {**os.environ, **env},
                cwd=run_dir.parent,
                start_new_session=True,
            )

    def remaining(self) -> float:
        """Seconds left until the deadline (negative once it has passed)."""
        return self.deadline - time.monotonic()

    def wait(self) -> int | None:
        """The supervisor's exit status once it exits, or None if the run overran its
        deadline: then its process group is killed (its names are left: see :meth:`clean`)."""
        try:
            return self.proc.wait(max(self.remaining(), LAST_WAIT_S))
        except subprocess.TimeoutExpired:
            kill_group(self.proc)
            return None

    def close(self) -> None:
        """Kill the run's process group if its supervisor still runs (its holder gave up)."""
        if self.proc.poll() is None:
            kill_group(self.proc)

    def clean(self) -> list[str]:
        return clean_names(self.run_dir)

    def tail(self, lines: int = TAIL_LINES) -> str:
        return tail_of(self.out_path, lines)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def clean_names(run_dir: Path) -> list[str]:
    """Unlink a run's shared-memory names, as ``ringfence clean RUN_DIR`` does, and return
    them (none if its supervisor never got as far as writing names.json)."""
    if not (run_dir / "names.json").is_file():
        return []
    return names.clean_run(run_id_of(str(run_dir)))


def read_log(run_dir: Path, instance: str) -> list[dict[str, Any]]:
    """The lines of ``<run_dir>/<instance>.jsonl`` (``worker-0``, ``store-1``);
    :class:`RunError` naming the file if it is missing or a line is not JSON."""
    path = run_dir / f"{instance}.jsonl"
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RunError(f"{path}: cannot read the log: {e}") from None
    lines = []
    for number, raw in enumerate(data.splitlines(), 1):
        try:
            lines.append(orjson.loads(raw))
        except orjson.JSONDecodeError as e:
            raise RunError(f"{path} line {number}: not JSON: {e}") from None
    return lines


def tail_of(out_path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a run's output file ("" before it exists)."""
    if not out_path.is_file():
        return ""
    return "\n".join(out_path.read_text(errors="replace").splitlines()[-lines:])


@dataclass(frozen=True, slots=True)
class Finished:
    """A run that exited by itself with status 0, and what it wrote at its end."""

    wall_s: float  # from its start to its exit, start-up included
    tail: str  # the last TAIL_LINES lines of its output
    summary: dict[str, Any]  # summary.json ({} if the run wrote none)
    outputs: list[dict[str, Any]]  # the lines of outputs.jsonl ([] if the run wrote none)


def run(
    run_dir: Path,
    settings: Sequence[str],
    *,
    what: str,
    timeout: float,
    workload: str | None = None,
    env: Mapping[str, str] | None = None,
    needs_summary: bool = False,
) -> Finished:
    """Launch a run (see :class:`Launched`) and wait for it to exit, ``timeout`` seconds
    at most; the run dir is kept.

    :class:`RunError` naming ``what``: "``what`` killed after ``timeout`` s" when it
    overran (its process group killed, its names unlinked); "``what`` exited with status
    N" and the tail of its output when it exited nonzero or, with ``needs_summary``,
    wrote no summary.json or outputs.jsonl. If this process is interrupted while it
    waits, the run's process group is killed.
    """
    with Launched(run_dir, settings, timeout=timeout, workload=workload, env=env) as launched:
        code = launched.wait()
        if code is None:
            launched.clean()
            raise RunError(f"{what} killed after {timeout:g} s")
    wall_s = time.monotonic() - launched.started
    tail = launched.tail()
    summary_path, outputs_path = run_dir / SUMMARY, run_dir / OUTPUTS
    written = summary_path.is_file() and outputs_path.is_file()
    if code != 0 or (needs_summary and not written):
        raise RunError(f"{what} exited with status {code}:\n{tail}")
    summary: dict[str, Any] = (
        orjson.loads(summary_path.read_bytes()) if summary_path.is_file() else {}
    )
    outputs: list[dict[str, Any]] = (
        [orjson.loads(line) for line in outputs_path.read_bytes().splitlines() if line]
        if outputs_path.is_file()
        else []
    )
    return Finished(wall_s=wall_s, tail=tail, summary=summary, outputs=outputs)

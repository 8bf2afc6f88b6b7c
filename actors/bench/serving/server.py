"""The one way the serving benchmark runs ``ringfence serve``: start it, wait for its
listening line, read its front end's CPU time, stop it.

Contract:

* Each server is a session of its own (its supervisor leads a process group holding every
  actor it spawns), started on a TCP port this module found free, with ``--run-dir``.
* :meth:`Served.stop` sends SIGINT to the server's pid and waits for it with a deadline;
  one that overruns is SIGKILLed by its process group. Either way the run's shared-memory
  names are unlinked afterwards, and the names that had to be unlinked are reported (a
  clean stop leaves none).
* A reader thread copies the server's output, line by line, into ``<run_dir>.out`` (so the
  pipe never fills) and hands the listening and ready lines to :meth:`Served.__init__`,
  which waits for both ``start_timeout`` seconds at most.

Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from ringfence.actors.bench import launcher
from ringfence.actors.bench.launcher import RunError, kill_group

# ``ringfence serve: listening on http://HOST:PORT (front end pid N)``
LISTENING = re.compile(r"listening on (?P<url>https?://\S+?) \(front end pid (?P<pid>\d+)\)")
# Printed once every actor is live: before it, a request may be answered 503 (starting).
READY = re.compile(r"^ringfence serve: ready$")
TAIL_LINES = 10  # lines of the server's output a RunError quotes
STOP_S = 60.0  # how long a stopped server may take to exit before it is killed
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process ``pid`` has used (``/proc/PID/stat`` fields 14
    and 15); FileNotFoundError when it is gone."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat[stat.rindex(")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15, counted from 3
    return (utime + stime) / _CLOCK_TICKS


def _copy_lines(source: IO[bytes], out_path: Path, found: queue.Queue[str | None]) -> None:
    """Copy ``source`` into ``out_path``; put each listening or ready line on ``found``,
    and None once ``source`` ends (the server exited)."""
    with out_path.open("wb") as out:
        for raw in source:
            out.write(raw)
            out.flush()
            line = raw.decode(errors="replace").rstrip("\n")
            if LISTENING.search(line) or READY.search(line):
                found.put(line)
    found.put(None)


def _wait_ready(found: queue.Queue[str | None], timeout: float) -> re.Match[str] | bool:
    """The listening line's match once the ready line came too; else whether the server's
    output ended (True) or ``timeout`` seconds passed first (False)."""
    deadline = time.monotonic() + timeout
    listening = None
    while True:
        try:
            line = found.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            return False
        if line is None:
            return True
        listening = listening or LISTENING.search(line)
        if listening is not None and READY.search(line):
            return listening


class Served:
    """One ``ringfence serve`` into ``run_dir`` on ``settings`` (``--set`` overrides), on a
    free port of 127.0.0.1, started in its own session; returns once it has printed its
    listening line and then ``ringfence serve: ready`` (every actor live).

    ``url`` is its base URL and ``frontend_pid`` its front end's pid, both from the
    listening line. :class:`RunError` with the tail of its output when it exits first or
    is not ready within ``start_timeout`` seconds (it is then stopped).
    """

    __slots__ = ("frontend_pid", "out_path", "proc", "reader", "run_dir", "url")

    def __init__(
        self,
        run_dir: Path,
        settings: Sequence[str],
        *,
        start_timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> None:
        args = [*launcher.ringfence_command(), "serve", "--run-dir", str(run_dir)]
        args += ["--host", "127.0.0.1", "--port", str(free_port())]
        for setting in settings:
            args += ["--set", setting]
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self.out_path = run_dir.with_name(f"{run_dir.name}.out")
        found: queue.Queue[str | None] = queue.Queue()
        # A session of its own: one killpg ends the supervisor and every actor.
        self.proc: subprocess.Popen[bytes] = subprocess.Popen(
            args,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=None if env is None else {**os.environ, **env},
            cwd=run_dir.parent,
            start_new_session=True,
        )
        assert self.proc.stdout is not None
        self.reader = threading.Thread(
            target=_copy_lines, args=(self.proc.stdout, self.out_path, found), daemon=True
        )
        self.reader.start()
        match = _wait_ready(found, start_timeout)
        if not isinstance(match, re.Match):
            self.stop(deadline_s=start_timeout)  # an ended output: it is exiting, or has
            what = f"exited (status {self.proc.returncode})" if match else "was not ready"
            raise RunError(f"ringfence serve {what} within {start_timeout:g} s:\n{self.tail()}")
        self.url = match["url"]
        self.frontend_pid = int(match["pid"])

    def frontend_cpu_s(self) -> float:
        """CPU seconds the front end process has used so far."""
        return cpu_seconds(self.frontend_pid)

    def stop(self, *, deadline_s: float) -> list[str]:
        """SIGINT the server and wait ``deadline_s`` for it to exit, then SIGKILL its group
        if it still runs; unlink what its run left in /dev/shm and return those names.
        Idempotent."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(deadline_s)
            except subprocess.TimeoutExpired:
                kill_group(self.proc)
        # An actor that outlived its supervisor would hold the run's names: end the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.reader.join(deadline_s)
        return launcher.clean_names(self.run_dir)

    def tail(self, lines: int = TAIL_LINES) -> str:
        return launcher.tail_of(self.out_path, lines)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop(deadline_s=STOP_S)

"""The one way the serving benchmarks run ``ringfence serve`` and ``ringfence router``:
start one, wait for its listening and ready lines, read its CPU time, stop it.

Contract:

* Each server is a session of its own (a serve's supervisor leads a process group holding
  every actor it spawns), started on a TCP port this module found free.
* :meth:`Started.stop` sends SIGINT to the server's pid and waits for it with a deadline;
  one that overruns is SIGKILLed by its process group. A serve's run then has its
  shared-memory names unlinked, and the names that had to be unlinked are reported (a
  clean stop leaves none).
* A reader thread copies the server's output, line by line, into a file (so the pipe
  never fills) and hands the listening and ready lines to :meth:`Started.__init__`, which
  waits for both ``start_timeout`` seconds at most.

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

from ringfence.actors.tools.bench import launcher
from ringfence.actors.tools.bench.launcher import RunError, kill_group

# ``ringfence serve: listening on http://HOST:PORT (front end pid N)``
LISTENING = re.compile(r"listening on (?P<url>https?://\S+?) \(front end pid (?P<pid>\d+)\)")
# Printed once every actor is live: before it, a request may be answered 503 (starting).
READY = re.compile(r"^ringfence serve: ready$")
# ``ringfence router: listening on http://HOST:PORT (pid N)``, then its ready line.
ROUTER_LISTENING = re.compile(
    r"^ringfence router: listening on (?P<url>https?://\S+?) \(pid (?P<pid>\d+)\)"
)
ROUTER_READY = re.compile(r"^ringfence router: ready$")
TAIL_LINES = 10  # lines of the server's output a RunError quotes
STOP_S = 60.0  # how long a stopped server may take to exit before it is killed
_CPUCLOCK_SCHED = 2  # Linux's process CPU clock kinds: 0 prof, 1 virt, 2 sched (all time run)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process ``pid`` (every thread of it) has used, to the
    nanosecond; FileNotFoundError when it is gone.

    Read from the process's CPU clock, the id ``clock_getcpuclockid(3)`` gives on Linux
    (``(~pid << 3) | 2``: the process's scheduler clock), not from ``/proc/PID/stat``, which
    counts in clock ticks of 10 ms: more than a router now spends on a short cell of
    requests (fourteen, in the quick form the tests run)."""
    try:
        return time.clock_gettime((~pid << 3) | _CPUCLOCK_SCHED)
    except OSError as e:  # EINVAL: no such process
        raise FileNotFoundError(f"no process {pid}: {e}") from e


def _copy_lines(
    source: IO[bytes],
    out_path: Path,
    found: queue.Queue[str | None],
    patterns: tuple[re.Pattern[str], ...],
) -> None:
    """Copy ``source`` into ``out_path``; put each line that one of ``patterns`` finds on
    ``found``, and None once ``source`` ends (the server exited)."""
    with out_path.open("wb") as out:
        for raw in source:
            out.write(raw)
            out.flush()
            line = raw.decode(errors="replace").rstrip("\n")
            if any(pattern.search(line) for pattern in patterns):
                found.put(line)
    found.put(None)


def _wait_ready(
    found: queue.Queue[str | None],
    timeout: float,
    listening: re.Pattern[str],
    ready: re.Pattern[str],
) -> re.Match[str] | bool:
    """The ``listening`` line's match once a ``ready`` line came too; else whether the
    server's output ended (True) or ``timeout`` seconds passed first (False)."""
    deadline = time.monotonic() + timeout
    match = None
    while True:
        try:
            line = found.get(timeout=max(deadline - time.monotonic(), 0.0))
        except queue.Empty:
            return False
        if line is None:
            return True
        match = match or listening.search(line)
        if match is not None and ready.search(line):
            return match


class Started:
    """A server command (``args``) started in a session of its own in ``cwd``; returns once
    it has printed a line ``listening`` finds and then one ``ready`` finds.

    Its stdout goes line by line to ``out_path``, its stderr there too unless
    ``stderr_path`` names a file of its own. ``url`` and ``pid`` come from the listening
    line. :class:`RunError` naming ``what``, with the tail of its output, when it exits
    first or is not ready within ``start_timeout`` seconds (it is then stopped).
    """

    __slots__ = ("out_path", "pid", "proc", "reader", "url")

    def __init__(
        self,
        args: Sequence[str],
        *,
        what: str,
        out_path: Path,
        cwd: Path,
        listening: re.Pattern[str],
        ready: re.Pattern[str],
        start_timeout: float,
        env: Mapping[str, str] | None = None,
        stderr_path: Path | None = None,
    ) -> None:
        self.out_path = out_path
        found: queue.Queue[str | None] = queue.Queue()
        with contextlib.ExitStack() as files:
            stderr: int | IO[bytes] = subprocess.STDOUT
            if stderr_path is not None:
                stderr = files.enter_context(stderr_path.open("wb"))
            # A session of its own: one killpg ends the server and all it started.
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                list(args),
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=None if env is None else {**os.environ, **env},
                cwd=cwd,
                start_new_session=True,
            )
        assert self.proc.stdout is not None
        self.reader = threading.Thread(
            target=_copy_lines,
            args=(self.proc.stdout, out_path, found, (listening, ready)),
            daemon=True,
        )
        self.reader.start()
        match = _wait_ready(found, start_timeout, listening, ready)
        if not isinstance(match, re.Match):
            self.stop(deadline_s=start_timeout)  # an ended output: it is exiting, or has
            how = f"exited (status {self.proc.returncode})" if match else "was not ready"
            raise RunError(f"{what} {how} within {start_timeout:g} s:\n{self.tail()}")
        self.url = match["url"]
        self.pid = int(match["pid"])

    def stop(self, *, deadline_s: float) -> list[str]:
        """SIGINT the server and wait ``deadline_s`` for it to exit, then SIGKILL its group
        if it still runs. Idempotent. What it left behind: none (see :class:`Served`)."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(deadline_s)
            except subprocess.TimeoutExpired:
                kill_group(self.proc)
        # A process that outlived its leader (an actor, a worker): end the whole group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.reader.join(deadline_s)
        return []

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


class Served(Started):
    """One ``ringfence serve`` into ``run_dir`` on ``settings`` (``--set`` overrides), on a
    free port of 127.0.0.1 (see :class:`Started`): ready once every actor is live.
    ``pid`` is its front end's; its output goes to ``<run_dir>.out``."""

    __slots__ = ("run_dir",)

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
        super().__init__(
            args,
            what="ringfence serve",
            out_path=run_dir.with_name(f"{run_dir.name}.out"),
            cwd=run_dir.parent,
            listening=LISTENING,
            ready=READY,
            start_timeout=start_timeout,
            env=env,
        )

    @property
    def frontend_pid(self) -> int:
        return self.pid

    def frontend_cpu_s(self) -> float:
        """CPU seconds the front end process has used so far."""
        return cpu_seconds(self.pid)

    def stop(self, *, deadline_s: float) -> list[str]:
        """:meth:`Started.stop`, then unlink what the run left in /dev/shm and return those
        names (a clean stop leaves none)."""
        super().stop(deadline_s=deadline_s)
        return launcher.clean_names(self.run_dir)


class Routed(Started):
    """One ``ringfence router`` over ``prefill`` and ``decode`` instance URLs, on a free
    port of 127.0.0.1, with ``options`` (its own flags, as ``["--prefill-timeout-s",
    "30"]``); its stdout goes to ``<folder>/router.out``, its log (stderr: one JSON line
    per event) to ``<folder>/router.jsonl``."""

    __slots__ = ("log_path",)

    def __init__(
        self,
        folder: Path,
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        start_timeout: float,
        options: Sequence[str] = (),
    ) -> None:
        args = [*launcher.ringfence_command(), "router", "--host", "127.0.0.1"]
        args += ["--port", str(free_port()), "--start-timeout-s", f"{start_timeout:g}"]
        args += [arg for url in prefill for arg in ("--prefill", url)]
        args += [arg for url in decode for arg in ("--decode", url)]
        folder.mkdir(parents=True, exist_ok=True)
        self.log_path = folder / "router.jsonl"
        super().__init__(
            [*args, *options],
            what="ringfence router",
            out_path=folder / "router.out",
            cwd=folder,
            listening=ROUTER_LISTENING,
            ready=ROUTER_READY,
            start_timeout=start_timeout,
            stderr_path=self.log_path,
        )

    def tail(self, lines: int = TAIL_LINES) -> str:
        """The last lines of its stdout and of its log (where its refusals go)."""
        return "\n".join(
            part for part in (super().tail(lines), launcher.tail_of(self.log_path, lines)) if part
        )

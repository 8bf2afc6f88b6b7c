"""Run ``ringfence launch`` as a subprocess of a test: start it, follow its logs, reap it.

:func:`launched` starts the supervisor with its own marker in the environment (which
every actor process inherits), yields a :class:`Launch`, and on the way out kills
what is left of that launch (only processes carrying the marker, by pid), runs
``ringfence clean RUN_ID --force`` and asserts no name of the run is left. The
conftest leak guard knows only run ids issued in the test process, so this is the
check for a launched run.

Waiting: the supervisor and the actors publish progress in their JSON-lines logs and
in shared-memory counters, but nothing rings a doorbell the test owns, so the waits
here re-read a file or a counter every ``POLL_S`` until a deadline. That is the one
place in the tests that polls; every wait has a deadline and fails naming what it
waited for.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from ringfence.actors.http.env import API_KEY_ENV, INSTANCE_KEY_ENV
from ringfence.actors.tools.testing.demo import APPLIED
from ringfence.runtime.control import InstanceControl
from ringfence.runtime.manifest import Manifest, read_manifest
from ringfence.shm import names
from ringfence.shm.counter import CounterBlock
from ringfence.shm.liveness import ProcessStamp

DEMO_TOPOLOGY = "ringfence.actors.tools.testing.demo:TOPOLOGY"
TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent
RINGFENCE = Path(sys.executable).with_name("ringfence")  # the venv's console script
EMBED_EXAMPLE = REPO_DIR / "scripts" / "embed_example"
SUPERVISOR = "supervisor-0"
MARK_VAR = "RFTEST_LAUNCH_MARK"  # test-only, read by no library code: tags a launch
POLL_S = 0.02
START_TIMEOUT_S = 20.0  # spawn context: every actor imports the runtime afresh
EXIT_TIMEOUT_S = 30.0

# Settings that keep a launched run quick to start, watch and stop in a test.
QUICK = ("runtime.heartbeat_s=0.1", "runtime.stop_timeout_s=5.0")
_RUN_LINE = re.compile(r"^ringfence (?:launch|serve): run ([a-z0-9]+) in ", re.MULTILINE)


def launch_env(mark: str | None = None) -> dict[str, str]:
    """The environment of a launched process: tests/ importable (fixture_actors), and the mark;
    without the user's API keys (a test that wants keys gives its own)."""
    env = dict(os.environ)
    for var in (API_KEY_ENV, INSTANCE_KEY_ENV):
        env.pop(var, None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(TESTS_DIR), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    if mark is not None:
        env[MARK_VAR] = mark
    return env


def ringfence(
    *args: str | Path, timeout: float = EXIT_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run the ``ringfence`` command to completion; its output is captured as text."""
    return subprocess.run(
        [str(RINGFENCE), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=launch_env(),
        check=False,
    )


def read_events(path: Path, since_ns: int = 0) -> list[dict[str, Any]]:
    """The whole lines of a JSON-lines log written at or after ``since_ns`` (monotonic)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")[:-1]  # a line still being appended has no newline yet
    records = [orjson.loads(line) for line in lines if line]
    return [r for r in records if r["mono_ns"] >= since_ns]


def matches(record: dict[str, Any], event: str | None, fields: dict[str, Any]) -> bool:
    return (event is None or record["event"] == event) and all(
        record.get(k) == v for k, v in fields.items()
    )


def carries_mark(pid: int, mark: str) -> bool:
    """True if process ``pid`` exists, is not a zombie, and was started with ``mark``."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    stamp = ProcessStamp.of(pid)
    return (
        stamp is not None
        and stamp.is_alive()
        and f"{MARK_VAR}={mark}".encode() in environ.split(b"\0")
    )


def marked_pids(mark: str) -> set[int]:
    """Every live process started with ``mark`` (a launch's supervisor and actors)."""
    pids = (int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit())
    return {pid for pid in pids if carries_mark(pid, mark)}


def wait_until(what: str, ready: Callable[[], bool], timeout: float) -> None:
    """Re-check ``ready`` every POLL_S until it holds; AssertionError naming ``what`` if not."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(POLL_S)  # nothing to block on: see the module docstring


def wait_gone(stamps: list[ProcessStamp], timeout: float) -> None:
    """Wait until none of these processes is alive (they need not be our children)."""
    wait_until(
        f"processes {[s.pid for s in stamps if s.is_alive()]} to exit",
        lambda: not any(s.is_alive() for s in stamps),
        timeout,
    )


@dataclass
class Launch:
    """One ``ringfence launch`` process and its run dir, as seen from the test."""

    proc: subprocess.Popen[bytes]
    run_dir: Path
    mark: str
    since_ns: int  # monotonic time just before the launch: older log lines are not ours
    out_path: Path
    err_path: Path
    _run_id: str | None = field(default=None, repr=False)

    # Output and logs.

    def stdout(self) -> str:
        return self.out_path.read_text()

    def stderr(self) -> str:
        return self.err_path.read_text()

    def log_path(self, log: str = SUPERVISOR) -> Path:
        return self.run_dir / f"{log}.jsonl"

    def events(
        self, event: str | None = None, *, log: str = SUPERVISOR, **fields: Any
    ) -> list[dict[str, Any]]:
        """This launch's lines of log ``<log>.jsonl``, optionally one event with given fields."""
        if log == SUPERVISOR:
            fields = {"pid": self.proc.pid, **fields}  # an earlier run in the dir appends too
        return [
            r for r in read_events(self.log_path(log), self.since_ns) if matches(r, event, fields)
        ]

    def wait_for_event(
        self, event: str, *, timeout: float = START_TIMEOUT_S, log: str = SUPERVISOR, **fields: Any
    ) -> dict[str, Any]:
        """The first line of ``event`` (with ``fields``) in ``<log>.jsonl``, once it is there.

        Fails at once if the supervisor has exited and the line is not in its log.
        """
        found: list[dict[str, Any]] = []

        def seen() -> bool:
            exited = log == SUPERVISOR and self.proc.poll() is not None
            found[:] = self.events(event, log=log, **fields)
            if not found and exited:
                raise AssertionError(
                    f"the supervisor exited ({self.proc.returncode}) without logging "
                    f"{event} {fields}; its log:\n{self.tail()}"
                )
            return bool(found)

        wait_until(f"{event} {fields} in {log}.jsonl", seen, timeout)
        return found[0]

    def tail(self, lines: int = 30) -> str:
        path = self.log_path()
        text = path.read_text() if path.exists() else ""
        return "\n".join([*text.splitlines()[-lines:], self.stderr()])

    # The run.

    @property
    def run_id(self) -> str:
        """The run id, from the supervisor's first line (printed before it creates anything)."""
        if self._run_id is None:
            wait_until(
                "the supervisor to announce its run",
                lambda: bool(_RUN_LINE.search(self.stdout())) or self.proc.poll() is not None,
                START_TIMEOUT_S,
            )
            match = _RUN_LINE.search(self.stdout())
            assert match, f"no run announced; stderr: {self.stderr()}"
            self._run_id = match[1]
        return self._run_id

    def manifest(self) -> Manifest:
        manifest = read_manifest(self.run_dir)
        assert manifest.run_id == self.run_id
        return manifest

    def actors(self) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = orjson.loads((self.run_dir / "actors.json").read_bytes())
        return rows

    def actor(self, instance: str) -> dict[str, Any]:
        (row,) = [r for r in self.actors() if r["id"] == instance]
        return row

    def wait_ready(self, *instances: str, timeout: float = START_TIMEOUT_S) -> None:
        """Wait until each instance (default: every one) has reported ready."""
        start = self.wait_for_event("run.start", timeout=timeout)
        for instance in instances or start["instances"]:
            self.wait_for_event("actor.ready", timeout=timeout, instance=instance)

    def child_stamps(self) -> list[ProcessStamp]:
        """The processes actors.json lists that are alive and belong to this launch."""
        stamps = [ProcessStamp.of(r["pid"]) for r in self.actors() if r["pid"] is not None]
        return [s for s in stamps if s is not None and carries_mark(s.pid, self.mark)]

    def kill_actor(self, instance: str) -> int:
        """SIGKILL the current process of ``instance`` (checked to be this launch's); its pid."""
        pid = self.actor(instance)["pid"]
        assert carries_mark(pid, self.mark), f"{instance} pid {pid} is not a live actor of ours"
        os.kill(pid, signal.SIGKILL)
        return int(pid)

    def send_signal(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)

    def wait(self, timeout: float = EXIT_TIMEOUT_S) -> int:
        """The supervisor's exit status, once it has exited."""
        return self.proc.wait(timeout)

    @contextmanager
    def demo_counters(self) -> Iterator[CounterBlock]:
        """The demo counter block, attached until the block exits (readable after the run)."""
        (entry,) = [c for c in self.manifest().counters if c.name == "demo"]
        block = CounterBlock.attach(entry.posix)
        try:
            yield block
        finally:
            block.close()

    def wait_for_counter(
        self, block: CounterBlock, index: int, above: int, timeout: float = EXIT_TIMEOUT_S
    ) -> int:
        """Wait while the supervisor runs until demo counter ``index`` exceeds ``above``."""

        def passed() -> bool:
            if block[index].value() > above:
                return True
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the supervisor exited ({self.proc.returncode}) with demo counter "
                    f"{index} at {block[index].value()} <= {above}; its log:\n{self.tail()}"
                )
            return False

        wait_until(f"demo counter {index} to pass {above}", passed, timeout)
        return block[index].value()

    def wait_for_heartbeats(self, instance: str, beats: int, timeout: float = 10.0) -> None:
        """Wait until ``instance``'s heartbeat watermark reaches ``beats``."""
        manifest = self.manifest()
        (entry,) = [e for e in manifest.instances if e.id == instance]
        block = CounterBlock.attach(manifest.control)
        try:
            heartbeat = InstanceControl.of(block, entry.index).heartbeat
            wait_until(
                f"{beats} heartbeats of {instance}", lambda: heartbeat.value() >= beats, timeout
            )
        finally:
            block.close()

    def wait_streaming(self, block: CounterBlock, above: int = 1000) -> int:
        """Wait until the sink has applied more than ``above`` items."""
        return self.wait_for_counter(block, APPLIED, above)


@contextmanager
def launched(
    tmp_path: Path,
    *sets: str,
    run_dir: Path | None = None,
    config: Path | None = None,
    command: tuple[str, ...] = ("launch",),
    prefix: Sequence[str] = (),
) -> Iterator[Launch]:
    """Start ``ringfence launch --set S ...`` in ``run_dir`` (default tmp_path/run); reap it after.

    ``command`` replaces ``launch`` (``("serve", "--port", "0")``: see ``tests/serving.py``).
    ``prefix`` runs it through a command that execs it (``Hosts.command``: in a network
    namespace), so that the process started is still the supervisor.

    On exit, whatever happened in the block: SIGKILL the supervisor if it still runs
    and every process carrying this launch's mark (its actors), wait for them to go,
    clean the run's names, and assert none is left.
    """
    run_dir = run_dir or tmp_path / "run"
    mark = uuid.uuid4().hex
    args: list[str] = [*prefix, str(RINGFENCE), *command, "--run-dir", str(run_dir)]
    # These tests follow the demo pipeline unless they name a topology (the built-in
    # default is the engine's).
    named = any(s.startswith("runtime.topology=") for s in sets)
    own = config is not None and "topology" in config.read_text()
    if not named and not own and command == ("launch",):
        sets = (f"runtime.topology={DEMO_TOPOLOGY}", *sets)
    if config is not None:
        args += ["--config", str(config)]
    for setting in sets:
        args += ["--set", setting]
    out_path, err_path = tmp_path / f"launch-{mark[:8]}.out", tmp_path / f"launch-{mark[:8]}.err"
    since_ns = time.monotonic_ns()
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(args, stdout=out, stderr=err, env=launch_env(mark), cwd=tmp_path)
    launch = Launch(proc, run_dir, mark, since_ns, out_path, err_path)
    try:
        yield launch
    finally:
        reap(launch)


def reap(launch: Launch) -> None:
    """End what is left of a launch (only its own processes, by pid) and remove its names."""
    if launch.proc.poll() is None:
        os.kill(launch.proc.pid, signal.SIGKILL)
    launch.proc.wait(EXIT_TIMEOUT_S)
    listed: set[int] = set()
    if (launch.run_dir / "actors.json").exists():
        listed = {r["pid"] for r in launch.actors() if r["pid"] is not None}
    left = [
        stamp
        for pid in listed | marked_pids(launch.mark)
        if carries_mark(pid, launch.mark) and (stamp := ProcessStamp.of(pid)) is not None
    ]
    for stamp in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(stamp.pid, signal.SIGKILL)
    wait_gone(left, EXIT_TIMEOUT_S)
    run_id = launch._run_id or _announced_run_id(launch)
    if run_id is None:
        return  # the supervisor never got as far as naming a run
    result = ringfence("clean", run_id, "--force")
    assert result.returncode == 0, result.stderr
    assert names.list_names(run_id) == []


def _announced_run_id(launch: Launch) -> str | None:
    match = _RUN_LINE.search(launch.stdout())
    return match[1] if match else None

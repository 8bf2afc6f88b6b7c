"""Failure records: why a spawned actor process ended with an error, for the supervisor to tell.

A spawned child whose instance fails (in ``attach``, ``on_start``, its loop or ``on_stop``)
writes one record before it exits, ``<run dir>/failures/<instance>.<incarnation>.json``::

    {"instance": "worker-0", "incarnation": 1, "where": "on_start",
     "error": "ValueError", "message": "...", "at": "actors/model/checkpoint.py:123 in read_config"}

``at`` is the innermost frame of the traceback, its file relative to the ``ringfence``
package when it lies inside it. The supervisor reads the record of the incarnation
that exited (:func:`read_failure`), logs it with the exit and, when that failure ends
the run, the command prints it (:meth:`Failure.lines`). A process killed by a signal
writes nothing: the supervisor then says how it ended (:func:`describe_exit`).
The record is written whole (a sibling renamed over), so a reader never sees half of one.
"""

from __future__ import annotations

import contextlib
import signal
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import orjson

from ringfence.runtime.manifest import write_atomic

FAILURES_DIR = "failures"
MESSAGE_CHARS = 2000  # a record's message is cut to this
_PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # the ringfence package's folder


@dataclass(frozen=True, slots=True, kw_only=True)
class Failure:
    """One instance's error: where in its life it happened, what, and the innermost frame."""

    instance: str  # "worker-0"
    incarnation: int
    where: str  # "attach", "on_start", "loop" or "on_stop"
    error: str  # the exception's class name
    message: str  # str(exception), cut to MESSAGE_CHARS
    at: str  # "actors/model/checkpoint.py:123 in read_config"; "" without a traceback

    @classmethod
    def of(cls, instance: str, incarnation: int, where: str, error: BaseException) -> Failure:
        frames = traceback.extract_tb(error.__traceback__)
        last = frames[-1] if frames else None
        at = f"{_short(last.filename)}:{last.lineno} in {last.name}" if last else ""
        return cls(
            instance=instance,
            incarnation=incarnation,
            where=where,
            error=type(error).__name__,
            message=str(error)[:MESSAGE_CHARS],
            at=at,
        )

    def lines(self) -> list[str]:
        """``worker-0 failed in on_start: ValueError: ...`` and, with a frame, ``  at ...``."""
        head = f"{self.instance} failed in {self.where}: {self.error}"
        head += f": {self.message}" if self.message else ""
        return [head, *([f"  at {self.at}"] if self.at else [])]


def _short(filename: str) -> str:
    """A frame's file relative to the ringfence package when inside it, else as given."""
    try:
        return Path(filename).resolve().relative_to(_PACKAGE_ROOT).as_posix()
    except (ValueError, OSError):
        return filename


def failure_path(run_dir: str | Path, instance: str, incarnation: int) -> Path:
    return Path(run_dir) / FAILURES_DIR / f"{instance}.{incarnation}.json"


def write_failure(run_dir: str | Path, failure: Failure) -> None:
    """Write ``failure``'s record in ``run_dir`` (OSError if the run dir cannot take it)."""
    path = failure_path(run_dir, failure.instance, failure.incarnation)
    path.parent.mkdir(exist_ok=True)
    write_atomic(path, orjson.dumps(asdict(failure)))


def record_failure(
    run_dir: str | Path, instance: str, incarnation: int, where: str, error: BaseException
) -> None:
    """Leave the record the supervisor reads, for the process that ran the instance; a run
    dir gone or full loses only the record."""
    with contextlib.suppress(OSError):
        write_failure(run_dir, Failure.of(instance, incarnation, where, error))


def read_failure(run_dir: str | Path, instance: str, incarnation: int) -> Failure | None:
    """The record of that incarnation of ``instance``, or None when it wrote none (or a
    malformed one: a record is an explanation, never a reason to fail the supervisor)."""
    try:
        raw = orjson.loads(failure_path(run_dir, instance, incarnation).read_bytes())
        return Failure(**raw)
    except (OSError, orjson.JSONDecodeError, TypeError):
        return None


def describe_exit(instance: str, exitcode: int | None) -> str:
    """How a process that left no record ended: ``relay-0 was killed by SIGKILL``."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"{instance} was killed by {name}"
    return f"{instance} exited with status {exitcode}"

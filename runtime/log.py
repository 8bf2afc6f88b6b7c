"""Structured logs: one JSON-lines file per actor instance, written through structlog.

Every line is one orjson-rendered object whose first keys are always::

    ts        wall-clock time, seconds since the epoch (float)
    mono_ns   time.monotonic_ns() of the writing process (merge key within one machine)
    level     "info", "trace", "warning" or "error"
    actor     the actor's name ("supervisor" for the supervisor)
    rank      its rank
    pid       the writing process
    epoch     the run epoch the instance started in (see supervisor.py)

followed by the event's own fields, and last ``event``: the event name, ``noun.verb``
(every name and its fields are listed in events.py). Lines are appended to an ``O_APPEND``
descriptor in whole lines, so a process killed mid-run leaves only whole lines, and
a restarted instance appends to the same file. Trace lines are buffered between the
driver's sleeps (see :class:`_LineWriter`); all other lines are written at once.

Cost: the structlog chain (a bound logger, two processors, orjson) is built once
per instance, never per call, and no structlog global configuration is touched, so
an actor embedded in a host process leaves the host's own structlog setup alone.
At level ``info`` the ``trace`` method is structlog's no-op; hot paths test
:attr:`ActorLog.tracing` first so they do not even build the keyword arguments. At
level ``trace`` it is the one path that skips structlog's processor chain (it runs
per message; the chain is most of a line's cost) and renders the same line itself.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Final

import orjson
import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from ringfence.runtime.secrets import redact, redactions

LEVELS: Final = {"info": logging.INFO, "trace": logging.DEBUG}
TRACE_BUFFER_BYTES: Final = 64 << 10
# structlog method name -> the level written in the line ("debug" is our trace level).
_LEVEL_NAMES: Final = {"debug": "trace", "info": "info", "warning": "warning", "error": "error"}


class _LineWriter:
    """The wrapped logger structlog writes rendered lines to.

    ``info``/``warning``/``error`` lines are written at once (with any buffered trace
    lines before them, so the file keeps the order of the calls). ``trace`` lines
    (structlog's ``debug``) are buffered and written when the buffer passes
    ``TRACE_BUFFER_BYTES``, on :meth:`flush` (the driver flushes before it sleeps)
    and on close: a trace line costs no system call of its own, and a process killed
    mid-burst loses at most the trace lines of that burst, never an info line.
    """

    __slots__ = ("_buffer", "_buffered", "_fd", "_lock", "_secrets")

    def __init__(self, fd: int | None) -> None:
        self._fd = fd
        self._secrets = redactions()  # what no line may hold (runtime/secrets.py)
        self._buffer: list[bytes] = []
        self._buffered = 0
        self._lock = threading.Lock()  # threads of one process may share a log

    def msg(self, line: bytes) -> None:
        if self._fd is None:
            return
        with self._lock:
            self._buffer.append(line + b"\n")
            self._write_buffer()

    def debug(self, line: bytes) -> None:
        if self._fd is None:
            return
        with self._lock:
            self._buffer.append(line + b"\n")
            self._buffered += len(line) + 1
            if self._buffered >= TRACE_BUFFER_BYTES:
                self._write_buffer()

    info = warning = error = msg

    def flush(self) -> None:
        if self._buffer:
            with self._lock:
                self._write_buffer()

    def _write_buffer(self) -> None:
        if not self._buffer or self._fd is None:
            return
        joined = b"".join(self._buffer)
        data = memoryview(redact(joined, self._secrets) if self._secrets else joined)
        self._buffer.clear()
        self._buffered = 0
        while data:
            data = data[os.write(self._fd, data) :]

    def close(self) -> None:
        self.flush()
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _stamp(_logger: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
    """Put the timestamps and level first, then the bound context, event and fields."""
    return {
        "ts": time.time(),
        "mono_ns": time.monotonic_ns(),
        "level": _LEVEL_NAMES.get(method, method),
        **event_dict,
    }


def _fallback(obj: object) -> object:
    """What JSONRenderer writes for a value JSON cannot hold: ``__structlog__()``, else repr."""
    render = getattr(obj, "__structlog__", None)
    return render() if render is not None else repr(obj)


_PROCESSORS: Final[list[Processor]] = [
    _stamp,
    structlog.processors.format_exc_info,
    structlog.processors.JSONRenderer(serializer=orjson.dumps),
]


class ActorLog:
    """The pre-bound logger of one actor instance (or the supervisor).

    ``info``/``warning``/``error``/``trace`` take ``(event, **fields)``. Safe to use
    from several threads of one process: the bound context is immutable and each
    line is one ``write``. ``close`` releases the file; logging after it is dropped.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        *,
        actor: str,
        rank: int,
        epoch: int,
        level: str = "info",
    ) -> None:
        if level not in LEVELS:
            raise ValueError(f"runtime.log_level must be one of {sorted(LEVELS)}, got {level!r}")
        self.level = level
        self.tracing = level == "trace"  # hot paths check this before building fields
        self.path = Path(path) if path is not None else None
        fd = None
        if self.path is not None:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._writer = _LineWriter(fd)
        wrapper = structlog.make_filtering_bound_logger(LEVELS[level])
        logger: Any = structlog.wrap_logger(
            self._writer, processors=_PROCESSORS, wrapper_class=wrapper, context_class=dict
        )
        self._logger = logger.bind(actor=actor, rank=rank, pid=os.getpid(), epoch=epoch)
        self._bind_methods()

    def _bind_methods(self) -> None:
        bound = self._logger
        self.info = bound.info
        self.warning = bound.warning
        self.error = bound.error
        # At info, structlog's no-op. At trace, the per-message path skips the processor
        # chain (about 3/4 of its cost) and renders the same keys in the same order as
        # _stamp + JSONRenderer, fallback included; test_log compares the two.
        self.trace = self._trace if self.tracing else bound.debug
        self._context = dict(bound._context)

    def _trace(self, event: str, **fields: Any) -> None:
        line = {
            "ts": time.time(),
            "mono_ns": time.monotonic_ns(),
            "level": "trace",
            **self._context,
            **fields,
            "event": event,
        }
        self._writer.debug(orjson.dumps(line, default=_fallback))

    def flush(self) -> None:
        """Write buffered trace lines now (the driver calls this before it sleeps)."""
        self._writer.flush()

    def close(self) -> None:
        """Flush and close the file. Idempotent; later calls write nothing."""
        self._writer.close()


def log_path(run_dir: str | os.PathLike[str], actor: str, rank: int) -> Path:
    """``<run dir>/<actor>-<rank>.jsonl``."""
    return Path(run_dir) / f"{actor}-{rank}.jsonl"

"""The router's log: one JSON line per event on stderr (events in runtime/events/serving.py).

The router is no actor of a run (it has no run dir), so its lines go to its stderr,
each one ``{"ts", "level", "actor": "router", "pid", <fields>, "event"}`` as an actor's
log line reads. One write per line; safe from any thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, TextIO

import orjson


class RouterLog:
    """``info``/``warning``/``error`` take ``(event, **fields)``; ``stream`` defaults to stderr."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def _write(self, level: str, event: str, fields: dict[str, Any]) -> None:
        line = {"ts": time.time(), "level": level, "actor": "router", "pid": os.getpid()}
        line.update(fields)
        line["event"] = event
        text = orjson.dumps(line, default=repr).decode() + "\n"
        stream = self._stream if self._stream is not None else sys.stderr
        with self._lock:
            stream.write(text)
            stream.flush()

    def info(self, event: str, **fields: Any) -> None:
        self._write("info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._write("warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._write("error", event, fields)

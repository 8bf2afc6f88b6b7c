"""What the catalogue says of one event, and the fields every line carries."""

from __future__ import annotations

from typing import Final, NamedTuple

COMMON: Final = ("ts", "mono_ns", "level", "actor", "rank", "pid", "epoch", "event")
EXCEPTION_FIELD: Final = "exception"


class Event(NamedTuple):
    level: str  # "info", "trace", "warning" or "error"
    fields: tuple[str, ...]
    doc: str


def event(level: str, fields: str, doc: str) -> Event:
    """An entry: ``fields`` space-separated, in the order the code usually logs them."""
    return Event(level, tuple(fields.split()), doc)

"""Every log event ringfence writes, with its fields: the contract log replay depends on.

Each line of ``<run dir>/<actor>-<rank>.jsonl`` carries the :data:`COMMON` fields
(see runtime/log.py), then the fields listed here for its event; an event logged with an
exception also carries ``exception`` (the formatted traceback). Names are
``noun.verb``. Add fields freely; renaming or removing one breaks replay. A test
parses the code and fails if it logs an event or a field not listed here.

The catalogue is one table, :data:`EVENTS`, kept in three parts by who logs them: a run's
machinery (:mod:`.runs`), the engine (:mod:`.engine`), the serving front ends
(:mod:`.serving`). An event name in two parts is an error at import.
"""

from __future__ import annotations

from typing import Final

from ringfence.runtime.events.engine import ENGINE_EVENTS
from ringfence.runtime.events.event import COMMON, EXCEPTION_FIELD, Event
from ringfence.runtime.events.runs import RUN_EVENTS
from ringfence.runtime.events.serving import SERVING_EVENTS

__all__ = ["COMMON", "EVENTS", "EXCEPTION_FIELD", "Event"]


def _merged(*parts: dict[str, Event]) -> dict[str, Event]:
    merged: dict[str, Event] = {}
    for part in parts:
        twice = sorted(merged.keys() & part.keys())
        if twice:
            raise ValueError(f"log events catalogued twice: {', '.join(twice)}")
        merged |= part
    return merged


EVENTS: Final[dict[str, Event]] = _merged(RUN_EVENTS, ENGINE_EVENTS, SERVING_EVENTS)

"""The event catalogue in runtime/events/ names every event the code logs, and only those."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import NamedTuple

import pytest

import ringfence.actors
import ringfence.cache
import ringfence.runtime
from ringfence.runtime.events import COMMON, EVENTS

RUNTIME_DIR = Path(ringfence.runtime.__file__).parent
CACHE_DIR = Path(ringfence.cache.__file__).parent
ACTORS_DIR = Path(ringfence.actors.__file__).parent
EMBED_EXAMPLE = RUNTIME_DIR.parent / "scripts" / "embed_example"  # absent from a wheel install
# The method called on an ActorLog -> the level written in the line.
METHODS = {"info": "info", "warning": "warning", "error": "error", "trace": "trace"}
NAME = re.compile(r"^[a-z_]+\.[a-z_]+$")


class Emit(NamedTuple):
    """One ``log.<method>("noun.verb", field=...)`` call found in the source."""

    where: str  # "driver.py:350"
    event: str
    level: str
    fields: tuple[str | None, ...]  # keyword names; None for a ``**splat``


def sources() -> list[Path]:
    """The modules to scan: every runtime, cache and actors module, and the embedding example."""
    paths = sorted(
        [*RUNTIME_DIR.rglob("*.py"), *CACHE_DIR.rglob("*.py"), *ACTORS_DIR.rglob("*.py")]
    )
    return [*paths, EMBED_EXAMPLE] if EMBED_EXAMPLE.is_file() else paths


def emits(path: Path) -> list[Emit]:
    """The log calls of one file whose first argument is a string constant with a dot."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in METHODS or not node.args:
            continue
        first = node.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue
        if "." not in first.value:
            continue
        fields = tuple(kw.arg for kw in node.keywords if kw.arg != "exc_info")
        where = f"{path.name}:{node.lineno}"
        found.append(Emit(where, first.value, METHODS[node.func.attr], fields))
    return found


ALL_EMITS = [emit for path in sources() for emit in emits(path)]


def test_the_scan_finds_the_log_calls_of_the_driver_and_the_supervisor():
    files = {emit.where.split(":")[0] for emit in ALL_EMITS}
    assert {"driver.py", "supervisor.py", "actor.py", "demo.py"} <= files
    assert len(ALL_EMITS) >= len(EVENTS)


def emit_param(emit: Emit) -> object:
    return pytest.param(emit, id=f"{emit.event}@{emit.where}")


def event_param(name: str) -> object:
    return pytest.param(name, id=name)


def test_every_logged_event_is_in_the_catalogue():
    unknown = [f"{e.where}: {e.event}" for e in ALL_EMITS if e.event not in EVENTS]
    assert unknown == []


@pytest.mark.parametrize("emit", [emit_param(e) for e in ALL_EMITS])
def test_a_logged_event_uses_the_level_and_fields_of_its_catalogue_entry(emit):
    event = EVENTS[emit.event]
    assert emit.level == event.level
    assert [f for f in emit.fields if f not in event.fields] == []


def test_every_catalogued_event_is_logged_somewhere():
    assert sorted(set(EVENTS) - {e.event for e in ALL_EMITS}) == []


@pytest.mark.parametrize("name", [event_param(n) for n in sorted(EVENTS)])
def test_a_catalogued_event_is_noun_dot_verb_with_a_known_level_and_own_fields(name):
    event = EVENTS[name]
    assert NAME.match(name)
    assert event.level in METHODS.values()
    assert event.doc
    assert len(set(event.fields)) == len(event.fields)
    # A field named like a common one would silently replace it in the line.
    assert sorted(set(event.fields) & set(COMMON)) == []

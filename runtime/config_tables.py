"""Reading TOML tables into a run's config sections, and writing them back.

The machinery behind ``runtime.config``: layers of tables merged key by key (remembering
which layer wrote each key, so an error names the file or ``--set`` it came from), each
table validated against its section dataclass from the annotations and the field
metadata (``RULES``), and a resolved config written back as TOML that loads equal. It
knows sections only as dataclasses whose class may name tools' sections in ``TOOLS``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import itertools
import math
import operator
import os
import re
import reprlib
import tomllib
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ringfence.runtime.imports import import_target
from ringfence.shm.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

D = TypeVar("D", bound="DataclassInstance")

ACTOR_NAME = r"[a-z][a-z0-9_]{0,31}"  # full match; the <name> of an [actors.<name>] table
RULES = frozenset({"ge", "gt", "le", "multiple_of", "pattern", "above"})
# A field whose metadata names ``SECRET`` (the environment variable that carries it to the
# actors) is written back empty: a run dir never holds a secret (runtime/secrets.py).
SECRET = "secret"
# A field whose metadata holds ``EXPLICIT`` is bookkeeping of the loader (the keys the
# layers wrote, ``RunConfig.explicit``), never a TOML key: not read, not written.
EXPLICIT = "explicit"
# A field whose metadata holds ``DEBUG`` exists to measure or debug (a baseline, an injected
# delay, a check turned off), never for a production run: the values that do (a tuple of
# them as --set writes them; empty: any but the default). Its doc in a written config and
# ``--set``'s help say so (:func:`debug_note`, :func:`debug_settings`).
DEBUG = "debug"
_INT64 = (-(2**63), 2**63 - 1)  # TOML integers are signed 64-bit
_BOUNDS = (("ge", operator.ge, ">="), ("gt", operator.gt, ">"), ("le", operator.le, "<="))
_EXPECTED = {bool: "a bool", int: "an int", float: "a number", str: "a string"}
_TOML_TYPES = {bool: "bool", int: "int", float: "float", str: "str", dict: "table", list: "array"}
_ESCAPES = dict(zip('"\\\b\t\n\f\r', '"\\btnfr', strict=True))  # TOML's short escapes
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f\x7f]')
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


class _Origin:
    """Which layer last wrote each dotted key, so an error can say where a value came from."""

    def __init__(self, default: str) -> None:
        self.default = default  # the source of a key no layer wrote
        self.writes: dict[str, tuple[int, str]] = {}  # dotted key -> (write number, source)
        self.counter = itertools.count()

    def record(self, key: str, source: str) -> None:
        self.writes[key] = (next(self.counter), source)

    def error(self, reason: str, key: str, *related: str) -> ConfigError:
        """An error at ``key``, blamed on the latest layer that wrote it or a ``related`` key."""
        source = max(self.writes.get(k, (-1, self.default)) for k in (key, *related))[1]
        return ConfigError(f"{where(source, key)}: {reason}", key=key)


def read_layer(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    source = os.fspath(path)
    try:
        with open(path, "rb") as f:
            return source, parse_toml(source, f.read())
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config file: {exc.strerror}") from None


def parse_toml(source: str, data: bytes) -> dict[str, Any]:
    # Besides its own errors (and not UTF-8), tomllib lets through the ValueError of an
    # integer longer than Python converts (4,300 digits) and the RecursionError of arrays
    # or inline tables nested deeper than the interpreter's stack.
    try:
        return tomllib.loads(data.decode())
    except ValueError as exc:  # TOMLDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: invalid TOML: arrays or tables nested too deeply") from None


def nest(key: str, value: object, source: str = "--set") -> dict[str, Any]:
    """The one-leaf table ``{"a": {"b": value}}`` of dotted key ``"a.b"``."""
    if not all(key.split(".")):
        raise ConfigError(f"{where(source, repr(key))}: empty key part", key=key)
    nested: dict[str, Any] = {}
    for part in reversed(key.split(".")):
        nested = {part: value}
        value = nested
    return nested


def resolve(
    cls: type[D],
    raw: dict[str, Any],
    layers: Iterable[tuple[str, Mapping[str, Any]]],
    default: str,
    written: set[str] | None = None,
) -> D:
    """``raw`` with each ``(source, table)`` layer merged in order, validated as ``cls``.
    ``written``, if given, receives the dotted key of every value and table a layer wrote."""
    origin = _Origin(default)
    for source, layer in layers:
        _merge(raw, layer, "", source, origin)
    built = _build(cls, raw, "", origin)
    if written is not None:
        written.update(origin.writes)
    return built


def _merge(
    dst: dict[str, Any], src: Mapping[str, Any], prefix: str, source: str, origin: _Origin
) -> None:
    """Write ``src`` into ``dst`` key by key (tables merge, anything else replaces)."""
    for name, value in src.items():
        key = prefix + name
        origin.record(key, source)
        if isinstance(value, dict):
            if not isinstance(dst.get(name), dict):
                dst[name] = {}
            _merge(dst[name], value, key + ".", source, origin)
        else:
            dst[name] = value


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def section_class(path: str) -> type:
    """The section class a tool's import path names."""
    cls = import_target(path)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{path} is not a config section (a dataclass)")
    return cls


def tables_of(cls: type) -> list[str]:
    """The fields of ``cls`` that are TOML tables (sections), in order."""
    return [n for n, tp in _hints(cls).items() if dataclasses.is_dataclass(tp)]


def _tools(cls: type) -> Mapping[str, str]:
    return getattr(cls, "TOOLS", {})


def _check_section(cls: type) -> None:
    """TypeError unless every scalar field of section ``cls`` and of the sections in it (its
    tools' included) has a doc and known rules: packages declare their sections themselves,
    so the loader checks each once."""
    if cls in _CHECKED:
        return
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        if f.metadata.get("tools") or f.metadata.get(EXPLICIT):
            continue
        if typing.get_origin(tp) is Mapping:
            tp = typing.get_args(tp)[1]
        if dataclasses.is_dataclass(tp):
            _check_section(typing.cast(type, tp))
            continue
        if "doc" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name}: a config field needs setting(..., doc)")
        if unknown := f.metadata.keys() - RULES - {"doc", SECRET, DEBUG}:
            raise TypeError(f"{cls.__name__}.{f.name}: unknown setting rules {sorted(unknown)}")
    for path in _tools(cls).values():
        _check_section(section_class(path))
    _CHECKED.add(cls)


_CHECKED: set[type] = set()  # the sections _check_section found sound


def _build(cls: type[D], raw: object, key: str, origin: _Origin) -> D:
    """Validate table ``raw`` at dotted ``key`` ("" for the root) against dataclass ``cls``."""
    if not isinstance(raw, dict):
        raise origin.error(f"expected a table, got {_describe(raw)}", key)
    _check_section(cls)
    tools = _tools(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not _bookkeeping(f)}
    for name in raw:
        if name not in fields and name not in tools:
            hint = suggest(name, [*fields, *tools], key)
            raise origin.error(f"unknown key{hint}", _join(key, name))
    hints = _hints(cls)
    values: dict[str, Any] = {}
    given: dict[str, object] = {}  # the tools' sections (the root only)
    for name, value in raw.items():
        where = _join(key, name)
        if name in fields:
            values[name] = _value(hints[name], fields[name].metadata, value, where, origin)
        else:
            given[name] = _build(section_class(tools[name]), value, where, origin)
    if given:
        values["tools"] = given
    obj = dataclasses.replace(cls(), **values)
    for f in fields.values():
        if (other := f.metadata.get("above")) and not getattr(obj, f.name) > getattr(obj, other):
            low, value = getattr(obj, other), getattr(obj, f.name)
            reason = f"must be > {_join(key, other)} ({low!r}), got {value!r}"
            raise origin.error(reason, _join(key, f.name), _join(key, other))
    return obj


def _bookkeeping(f: dataclasses.Field[Any]) -> bool:
    """A field that is no key of its table: the tools' sections (top-level tables of their
    own) and the loader's record of the keys written (:data:`EXPLICIT`)."""
    return bool(f.metadata.get("tools") or f.metadata.get(EXPLICIT))


def _value(tp: Any, meta: Mapping[str, Any], value: Any, key: str, origin: _Origin) -> object:
    """Check one value against its annotation ``tp`` and its metadata rules."""
    if dataclasses.is_dataclass(tp):
        return _build(typing.cast("type[DataclassInstance]", tp), value, key, origin)
    if typing.get_origin(tp) is Mapping:  # name -> table, e.g. [actors.<name>]
        if not isinstance(value, dict):
            raise origin.error(f"expected a table, got {_describe(value)}", key)
        for name in value:
            if not re.fullmatch(ACTOR_NAME, name):
                raise origin.error(f"bad name, must match {ACTOR_NAME}", _join(key, name))
        item = typing.get_args(tp)[1]
        return {name: _build(item, v, _join(key, name), origin) for name, v in value.items()}
    if typing.get_origin(tp) is Literal:
        if value not in (choices := typing.get_args(tp)):
            listed = ", ".join(map(repr, choices))
            raise origin.error(f"must be one of {listed}, got {reprlib.repr(value)}", key)
        return value
    if not (type(value) is tp or (tp is float and type(value) is int)):
        raise origin.error(f"expected {_EXPECTED[tp]}, got {_describe(value)}", key)
    value = float(value) if tp is float else value
    if reason := _rule_broken(meta, value):
        raise origin.error(reason, key)
    return value


def _rule_broken(meta: Mapping[str, Any], value: Any) -> str | None:
    """Why ``value`` breaks a rule of its field (or of every TOML value), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be finite, got {value!r}"
    if isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]:
        return f"must fit a signed 64-bit integer, got {value!r}"
    for name, holds, sign in _BOUNDS:
        if (bound := meta.get(name)) is not None and not holds(value, bound):
            return f"must be {sign} {bound}, got {value!r}"
    if (step := meta.get("multiple_of")) and value % step:
        return f"must be a multiple of {step}, got {value!r}"
    if (pattern := meta.get("pattern")) and not re.fullmatch(pattern[0], value):
        return f"must be {pattern[1]}, got {value!r}"
    return None


def _describe(value: object) -> str:
    return f"{_TOML_TYPES.get(type(value), type(value).__name__)} {reprlib.repr(value)}"


def where(source: str, key: str) -> str:
    # A command-line option reads as typed ("--set a.b"); a file is followed by a colon.
    return f"{source} {key}" if source.startswith("-") else f"{source}: {key}"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def suggest(name: str, candidates: Iterable[str], prefix: str) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {_join(prefix, close[0])}?)" if close else ""


def to_raw(obj: Any) -> Any:
    """The nested-dict form of a config (or of any value in one), as TOML would parse it."""
    if dataclasses.is_dataclass(obj):
        raw: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            if f.metadata.get("tools"):  # the tools' sections are top-level tables
                raw |= {name: to_raw(section) for name, section in getattr(obj, f.name).items()}
            elif not f.metadata.get(EXPLICIT):
                raw[f.name] = to_raw(getattr(obj, f.name))
        return raw
    if isinstance(obj, Mapping):
        return {name: to_raw(value) for name, value in obj.items()}
    return obj


def _subtables(obj: Any) -> list[tuple[str, Any, str]]:
    """``(name, section or mapping of sections, doc)`` of each table of ``obj``. At the root:
    the schema's own sections in its order, then the runtime's, the tools', the actors'."""
    found: list[tuple[str, Any, str]] = []
    hints = _hints(obj.__class__)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get("tools"):
            found += [(name, section, _doc(type(section))) for name, section in value.items()]
        elif dataclasses.is_dataclass(value) or isinstance(value, Mapping):
            # A section class, or Mapping[str, section class].
            cls = typing.get_args(hints[f.name])[1] if isinstance(value, Mapping) else hints[f.name]
            found.append((f.name, value, _doc(cls)))
    if not hasattr(type(obj), "TOOLS"):
        return found
    rank = {"runtime": 1, **dict.fromkeys(obj.tools, 2), "actors": 3}
    return sorted(found, key=lambda table: rank.get(table[0], 0))


def _doc(cls: type) -> str:
    return cls.__doc__ or cls.__name__


def debug_note(values: Sequence[str]) -> str:
    """The mark of a :data:`DEBUG` setting: ``[to measure or debug: lock, sync]``."""
    return f"[to measure or debug{': ' if values else ''}{', '.join(values)}]"


def debug_settings(cls: type, key: str = "") -> list[str]:
    """Every :data:`DEBUG` setting of section ``cls`` and the sections in it (the tools'
    aside), in their order: its dotted key, then the values that measure or debug."""
    found = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if _bookkeeping(f) or typing.get_origin(tp) is Mapping:
            continue  # no key of the table, or [actors.<name>] (whose policies have none)
        if dataclasses.is_dataclass(tp):
            found += debug_settings(typing.cast(type, tp), _join(key, f.name))
        elif DEBUG in f.metadata:
            values = f.metadata[DEBUG]
            found.append(_join(key, f.name) + (f" ({', '.join(values)})" if values else ""))
    return found


def dump_table(obj: Any, key: str, lines: list[str]) -> None:
    # TOML puts a table's own keys before any sub-table header, so scalars go first.
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.metadata.get(EXPLICIT):
            continue
        if not (dataclasses.is_dataclass(value) or isinstance(value, Mapping)):
            if f.metadata.get(SECRET):
                value = type(value)()  # redacted: the actors read it from the environment
            doc = f.metadata["doc"]
            if DEBUG in f.metadata:
                doc = f"{doc} {debug_note(f.metadata[DEBUG])}"
            lines += [f"# {doc}", f"{_dump_key(f.name)} = {_dump_value(value)}"]
    for name, value, doc in _subtables(obj):
        sub = _join(key, _dump_key(name))
        lines += ["", f"# {doc}"]
        if isinstance(value, Mapping):
            named = [(f"{sub}.{_dump_key(item)}", section) for item, section in value.items()]
        else:
            named = [(sub, value)]
        for i, (path, section) in enumerate(named):
            lines += [""] * (i > 0) + [f"[{path}]"]
            dump_table(section, path, lines)


def _dump_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)  # a float's repr always has a '.' or an exponent (or is inf/nan)
    if isinstance(value, str):
        return _dump_string(value)
    raise TypeError(f"cannot write {type(value).__name__} as a TOML value")


def _dump_string(text: str) -> str:
    escaped = _NEEDS_ESCAPE.sub(lambda m: "\\" + _ESCAPES.get(m[0], f"u{ord(m[0]):04x}"), text)
    return f'"{escaped}"'


def _dump_key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else _dump_string(name)

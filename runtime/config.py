"""Run configuration: one TOML file mapped onto frozen dataclasses, with a default for every key.

Each package owns its sections: a frozen, slotted, keyword-only dataclass next to the code
that reads it, whose fields carry a one-line doc and their rules in field metadata
(:func:`setting`). The runtime owns ``[runtime]`` and ``[actors.<name>]``
(:class:`RunConfig`). The schema of a whole run is a subclass of it that adds the other
packages' sections as typed fields; the runtime finds it by import path (:data:`SCHEMA`,
the actors' ``Config``), as it finds the topology, so it never imports a package above it.
Sections of tools (the demo pipeline, the protocol harness) are named by import path in
the schema's ``TOOLS`` and loaded the same way, so that no product module imports a tool;
:meth:`RunConfig.section` gives them by name.

Precedence, later wins: the built-in defaults, then the file given to :meth:`RunConfig.load`,
then each ``--set section.key=value`` override in order. Types come from the annotations
(``Literal`` for choices), docs and ranges from the metadata, and one generic walker
validates any table against them. Every problem raises :class:`ConfigError` whose message
starts with where the value came from (the file path or ``--set``), then the dotted key,
e.g. ``--set runtime.spinus: unknown key (did you mean runtime.spin_us?)``.
:func:`dump_config` writes TOML that loads back equal.
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
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ringfence.runtime.topology import import_target
from ringfence.shm.errors import ConfigError

# ruff: noqa: RUF009 (setting() returns a dataclasses.field(), which ruff cannot see)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
D = TypeVar("D", bound="DataclassInstance")

LogLevel = Literal["info", "trace"]
Placement = Literal["spawn", "external"]
Restart = Literal["never", "on-failure"]
Self = TypeVar("Self", bound="RunConfig")

# The schema of a whole run, by name: the runtime never imports the actors.
SCHEMA = "ringfence.actors.config:Config"
ACTOR_NAME = r"[a-z][a-z0-9_]{0,31}"  # full match; the <name> of an [actors.<name>] table
RULES = frozenset({"ge", "gt", "le", "multiple_of", "pattern", "above"})
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_IMPORT = (rf"{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*", "an import path 'module:ATTRIBUTE'")
_ENGINE = "ringfence.actors.engine:TOPOLOGY"  # by name: the runtime never imports actors
_INT64 = (-(2**63), 2**63 - 1)  # TOML integers are signed 64-bit
_BOUNDS = (("ge", operator.ge, ">="), ("gt", operator.gt, ">"), ("le", operator.le, "<="))
_EXPECTED = {bool: "a bool", int: "an int", float: "a number", str: "a string"}
_TOML_TYPES = {bool: "bool", int: "int", float: "float", str: "str", dict: "table", list: "array"}
_ESCAPES = dict(zip('"\\\b\t\n\f\r', '"\\btnfr', strict=True))  # TOML's short escapes
_NEEDS_ESCAPE = re.compile(r'["\\\x00-\x1f\x7f]')
_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def setting(default: T, doc: str, **rules: Any) -> T:
    """A scalar field: its default, its one-line doc and its rules, kept in field metadata.

    Rules (:data:`RULES`): ``ge``, ``gt``, ``le`` (bounds), ``multiple_of``, ``pattern``
    (``(regex, description)``, matched in full) and ``above`` (a sibling field this value
    must exceed). A package that may not import the runtime (the cache, the scheduler)
    declares its fields with its own two-line copy of this; the loader checks every
    section's metadata once, whoever wrote it (:func:`_check_section`).
    """
    return dataclasses.field(default=default, metadata={"doc": doc, **rules})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeConfig:
    """[runtime]: run dirs, logs, rings and the supervisor's clocks."""

    run_dir: str = setting("runs", "parent folder of run dirs")
    log_level: LogLevel = setting("info", "info, or trace for the full protocol trace")
    ring_bytes: int = setting(1 << 20, "bytes of a ring", ge=4096, le=1 << 30, multiple_of=8)
    spin_us: float = setting(50.0, "microseconds a waiter spins before it blocks", ge=0, le=100000)
    topology: str = setting(
        _ENGINE,
        "actor topology to launch, 'module:ATTRIBUTE': a Topology, or a function of the config",
        pattern=_IMPORT,
    )
    heartbeat_s: float = setting(0.5, "seconds between actor heartbeats", gt=0)
    heartbeat_timeout_s: float = setting(
        10.0,
        "seconds without a heartbeat before an actor counts as dead",
        gt=0,
        above="heartbeat_s",
    )
    ready_timeout_s: float = setting(60.0, "seconds the supervisor waits for ready actors", gt=0)
    stop_timeout_s: float = setting(10.0, "seconds an actor gets to stop before it is killed", gt=0)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ActorPolicy:
    """[actors.<name>]: where one actor runs and how the supervisor restarts it."""

    placement: Placement = setting("spawn", "spawn (by the supervisor) or external (embedded)")
    restart: Restart = setting("on-failure", "never, or on-failure: restart after it dies")
    max_restarts: int = setting(3, "restarts before the supervisor gives up", ge=0)
    backoff_s: float = setting(0.5, "delay before a restart; doubles after each one", ge=0)
    backoff_max_s: float = setting(10.0, "cap of the doubled restart delay", ge=0)
    threads: int = setting(
        0, "CPU threads of its process for torch/OpenMP (OMP_NUM_THREADS); 0 = their default", ge=0
    )


def _policies() -> Mapping[str, ActorPolicy]:
    return types.MappingProxyType({})


def _tool_sections() -> Mapping[str, object]:
    return types.MappingProxyType({})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """The resolved configuration of a run; each actor receives only its own section.

    This class holds what the runtime owns; a run's schema subclasses it with the other
    packages' sections (see the module docstring), and names its tools' sections in
    ``TOOLS`` (TOML table -> import path of the section class). ``actors`` and ``tools``
    are read-only mappings, sorted by name, over private copies: the config is immutable
    all the way down. They are left out of the hash (a mapping has none) and pickled as
    plain dicts. Load one with :meth:`load`, :meth:`loads` or :meth:`with_overrides`.
    """

    TOOLS: typing.ClassVar[Mapping[str, str]] = types.MappingProxyType({})

    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    actors: Mapping[str, ActorPolicy] = dataclasses.field(default_factory=_policies, hash=False)
    # Every tool's section by its TOML table; one a file leaves out has its defaults.
    tools: Mapping[str, object] = dataclasses.field(
        default_factory=_tool_sections, hash=False, metadata={"tools": True}
    )

    def __post_init__(self) -> None:
        actors = types.MappingProxyType(dict(sorted(self.actors.items())))
        object.__setattr__(self, "actors", actors)
        given = dict(self.tools)
        if unknown := given.keys() - self.TOOLS.keys():
            raise TypeError(f"{type(self).__name__} has no tool sections {sorted(unknown)}")
        tools = {
            name: given.get(name) or _section_class(path)() for name, path in self.TOOLS.items()
        }
        object.__setattr__(self, "tools", types.MappingProxyType(dict(sorted(tools.items()))))

    def __reduce__(self) -> tuple[Any, ...]:
        # A mappingproxy cannot be pickled, and a config travels to spawned actors.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        plain = {"actors": dict(self.actors), "tools": dict(self.tools)}
        return functools.partial(type(self), **fields | plain), ()

    @classmethod
    def load(
        cls: type[Self], path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()
    ) -> Self:
        """The defaults, then the TOML file at ``path`` (if given), then each override in order."""
        layers = [] if path is None else [_read(path)]
        layers += [("--set", _nest(*parse_override(text))) for text in overrides]
        return _resolve(cls, {}, layers, "defaults")

    @classmethod
    def loads(cls: type[Self], text: str, source: str = "<string>") -> Self:
        """The defaults, then the TOML document ``text``; errors name ``source``."""
        return _resolve(cls, {}, [(source, _parse(source, text.encode()))], "defaults")

    def with_overrides(self: Self, overrides: Mapping[str, object], source: str = "--set") -> Self:
        """This config with dotted-key ``overrides`` applied in order, validated like a file's."""
        layers = [(source, _nest(key, value, source)) for key, value in overrides.items()]
        return _resolve(type(self), _to_raw(self), layers, "config")

    def actor(self, name: str) -> ActorPolicy:
        """The policy configured for actor ``name``, or the default policy."""
        return self.actors.get(name, ActorPolicy())

    def section(self, name: str) -> object:
        """The section dataclass of TOML table ``name`` (``"cache"``, ``"cache.storage"``).

        ``""`` names the whole config (for actors that read several sections).
        """
        node: Any = self
        if not name:
            return node
        parts = name.split(".")
        for depth, part in enumerate(parts):
            tables = _tables(type(node))
            if depth == 0 and part in self.tools:
                node = self.tools[part]
                continue
            if part not in tables:
                key = ".".join(parts[: depth + 1])
                prefix = ".".join(parts[:depth])
                choices = [*tables, *self.tools] if depth == 0 else tables
                raise ConfigError(
                    f"{key}: unknown section{_suggest(part, choices, prefix)}", key=key
                )
            node = getattr(node, part)
        return node


def schema() -> type[RunConfig]:
    """The schema of a run (:data:`SCHEMA`), imported on first use."""
    cls = import_target(SCHEMA)
    if not (isinstance(cls, type) and issubclass(cls, RunConfig)):
        raise TypeError(f"{SCHEMA} is not a RunConfig subclass")
    return cls


def check_actor_names(cfg: RunConfig, valid: Iterable[str], source: str) -> None:
    """Raise ConfigError for an ``[actors.<name>]`` table whose name is not in ``valid``.

    The loader cannot know a topology's actor names; the runtime calls this once it does.
    """
    names = sorted(set(valid))
    for name in cfg.actors:
        if name not in names:
            key = f"actors.{name}"
            hint = _suggest(name, names, "actors")
            raise ConfigError(f"{_where(source, key)}: unknown actor{hint}", key=key)


def parse_override(text: str) -> tuple[str, object]:
    """Split ``"section.key=value"`` into the dotted key and the value.

    The value is read as a TOML value; if it is not one it is taken as a plain string, so
    ``model.device=cuda`` needs no quotes and ``runtime.spin_us=20`` gives a number.
    """
    key, eq, text_value = text.partition("=")
    key, text_value = key.strip(), text_value.strip()
    if not eq or not all(key.split(".")):
        raise ConfigError(f"--set {text!r}: expected section.key=value")
    try:
        parsed = tomllib.loads(f"v = {text_value}")
    except (ValueError, RecursionError):  # not TOML (see _parse for the other two)
        return key, text_value
    # A value with a newline could smuggle in more keys; then it is just text.
    return key, parsed["v"] if parsed.keys() == {"v"} else text_value


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: Sequence[str] = ()
) -> RunConfig:
    """:meth:`RunConfig.load` of the run's schema (:func:`schema`)."""
    return schema().load(path, overrides)


def loads_config(text: str, source: str = "<string>") -> RunConfig:
    """:meth:`RunConfig.loads` of the run's schema (:func:`schema`)."""
    return schema().loads(text, source)


def dump_config(cfg: RunConfig) -> str:
    """TOML text of every key of ``cfg``, defaults included, each under a ``# doc`` line.

    The schema's own sections come first, in its order, then the runtime's, the tools',
    and the actors' policies; loading the text gives back ``cfg``.
    """
    lines = ["# ringfence configuration, resolved: every key, defaults included."]
    _dump_table(cfg, "", lines)
    return "\n".join(lines) + "\n"


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
        return ConfigError(f"{_where(source, key)}: {reason}", key=key)


def _read(path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    source = os.fspath(path)
    try:
        with open(path, "rb") as f:
            return source, _parse(source, f.read())
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read config file: {exc.strerror}") from None


def _parse(source: str, data: bytes) -> dict[str, Any]:
    # Besides its own errors (and not UTF-8), tomllib lets through the ValueError of an
    # integer longer than Python converts (4,300 digits) and the RecursionError of arrays
    # or inline tables nested deeper than the interpreter's stack.
    try:
        return tomllib.loads(data.decode())
    except ValueError as exc:  # TOMLDecodeError and UnicodeDecodeError are ValueErrors
        raise ConfigError(f"{source}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{source}: invalid TOML: arrays or tables nested too deeply") from None


def _nest(key: str, value: object, source: str = "--set") -> dict[str, Any]:
    """The one-leaf table ``{"a": {"b": value}}`` of dotted key ``"a.b"``."""
    if not all(key.split(".")):
        raise ConfigError(f"{_where(source, repr(key))}: empty key part", key=key)
    nested: dict[str, Any] = {}
    for part in reversed(key.split(".")):
        nested = {part: value}
        value = nested
    return nested


def _resolve(
    cls: type[Self],
    raw: dict[str, Any],
    layers: Iterable[tuple[str, Mapping[str, Any]]],
    default: str,
) -> Self:
    origin = _Origin(default)
    for source, layer in layers:
        _merge(raw, layer, "", source, origin)
    return _build(cls, raw, "", origin)


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


def _section_class(path: str) -> type:
    """The section class a tool's import path names."""
    cls = import_target(path)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"{path} is not a config section (a dataclass)")
    return cls


def _tables(cls: type) -> list[str]:
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
        if f.metadata.get("tools"):
            continue
        if typing.get_origin(tp) is Mapping:
            tp = typing.get_args(tp)[1]
        if dataclasses.is_dataclass(tp):
            _check_section(typing.cast(type, tp))
            continue
        if "doc" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name}: a config field needs setting(..., doc)")
        if unknown := f.metadata.keys() - RULES - {"doc"}:
            raise TypeError(f"{cls.__name__}.{f.name}: unknown setting rules {sorted(unknown)}")
    for path in _tools(cls).values():
        _check_section(_section_class(path))
    _CHECKED.add(cls)


_CHECKED: set[type] = set()  # the sections _check_section found sound


def _build(cls: type[D], raw: object, key: str, origin: _Origin) -> D:
    """Validate table ``raw`` at dotted ``key`` ("" for the root) against dataclass ``cls``."""
    if not isinstance(raw, dict):
        raise origin.error(f"expected a table, got {_describe(raw)}", key)
    _check_section(cls)
    tools = _tools(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("tools")}
    for name in raw:
        if name not in fields and name not in tools:
            hint = _suggest(name, [*fields, *tools], key)
            raise origin.error(f"unknown key{hint}", _join(key, name))
    hints = _hints(cls)
    values: dict[str, Any] = {}
    given: dict[str, object] = {}  # the tools' sections (the root only)
    for name, value in raw.items():
        where = _join(key, name)
        if name in fields:
            values[name] = _value(hints[name], fields[name].metadata, value, where, origin)
        else:
            given[name] = _build(_section_class(tools[name]), value, where, origin)
    if given:
        values["tools"] = given
    obj = dataclasses.replace(cls(), **values)
    for f in fields.values():
        if (other := f.metadata.get("above")) and not getattr(obj, f.name) > getattr(obj, other):
            low, value = getattr(obj, other), getattr(obj, f.name)
            reason = f"must be > {_join(key, other)} ({low!r}), got {value!r}"
            raise origin.error(reason, _join(key, f.name), _join(key, other))
    return obj


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


def _where(source: str, key: str) -> str:
    # A command-line option reads as typed ("--set a.b"); a file is followed by a colon.
    return f"{source} {key}" if source.startswith("-") else f"{source}: {key}"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _suggest(name: str, candidates: Iterable[str], prefix: str) -> str:
    close = difflib.get_close_matches(name, list(candidates), n=1)
    return f" (did you mean {_join(prefix, close[0])}?)" if close else ""


def _to_raw(obj: Any) -> Any:
    """The nested-dict form of a config (or of any value in one), as TOML would parse it."""
    if dataclasses.is_dataclass(obj):
        raw: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            if f.metadata.get("tools"):  # the tools' sections are top-level tables
                raw |= {name: _to_raw(section) for name, section in getattr(obj, f.name).items()}
            else:
                raw[f.name] = _to_raw(getattr(obj, f.name))
        return raw
    if isinstance(obj, Mapping):
        return {name: _to_raw(value) for name, value in obj.items()}
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
    if not isinstance(obj, RunConfig):
        return found
    rank = {"runtime": 1, **dict.fromkeys(obj.tools, 2), "actors": 3}
    return sorted(found, key=lambda table: rank.get(table[0], 0))


def _doc(cls: type) -> str:
    return cls.__doc__ or cls.__name__


def _dump_table(obj: Any, key: str, lines: list[str]) -> None:
    # TOML puts a table's own keys before any sub-table header, so scalars go first.
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not (dataclasses.is_dataclass(value) or isinstance(value, Mapping)):
            lines += [f"# {f.metadata['doc']}", f"{_dump_key(f.name)} = {_dump_value(value)}"]
    for name, value, doc in _subtables(obj):
        sub = _join(key, _dump_key(name))
        lines += ["", f"# {doc}"]
        if isinstance(value, Mapping):
            named = [(f"{sub}.{_dump_key(item)}", section) for item, section in value.items()]
        else:
            named = [(sub, value)]
        for i, (path, section) in enumerate(named):
            lines += [""] * (i > 0) + [f"[{path}]"]
            _dump_table(section, path, lines)


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

"""Run configuration: one TOML file mapped onto frozen dataclasses, with a default for every key.

Each package owns its sections: a frozen, slotted, keyword-only dataclass next to the code
that reads it, whose fields carry a one-line doc and their rules in field metadata
(:func:`setting`). The runtime owns ``[runtime]`` and ``[actors.<name>]``
(:class:`RunConfig`). The schema of a whole run is a subclass of it that adds the other
packages' sections as typed fields; the runtime finds it by import path (:data:`SCHEMA`,
the actors' ``Config``), as it finds the topology, so it never imports a package above it.
Sections of tools (the demo pipeline, the protocol harness) are named by import path in
the schema's ``TOOLS`` and loaded the same way, so that no product module imports a tool;
:meth:`RunConfig.section` gives them by name. An actor receives only its own sections
(:meth:`RunConfig.sections`, ``Actor.config_section``); the whole config stays with the
composition root: the topology and the launch checks.

Precedence, later wins: the built-in defaults, then the file given to :meth:`RunConfig.load`,
then each ``--set section.key=value`` override in order. Types come from the annotations
(``Literal`` for choices), docs and ranges from the metadata, and one generic walker
validates any table against them. Every problem raises :class:`ConfigError` whose message
starts with where the value came from (the file path or ``--set``), then the dotted key,
e.g. ``--set runtime.spinus: unknown key (did you mean runtime.spin_us?)``.
:func:`dump_config` writes TOML that loads back equal. The walker that validates tables
and the TOML writer live in ``config_tables.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import tomllib
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ringfence.runtime.config_tables import (
    EXPLICIT,
    dump_table,
    nest,
    parse_toml,
    read_layer,
    resolve,
    section_class,
    suggest,
    tables_of,
    to_raw,
    where,
)
from ringfence.runtime.imports import import_target
from ringfence.shm.errors import ConfigError

# ruff: noqa: RUF009 (setting() returns a dataclasses.field(), which ruff cannot see)

if TYPE_CHECKING:
    pass

T = TypeVar("T")

LogLevel = Literal["info", "trace"]
Placement = Literal["spawn", "external", "hosted"]  # runtime/hosting.py: hosted
Restart = Literal["never", "on-failure"]
Wait = Literal["block", "poll"]
StartMethod = Literal["forkserver", "spawn"]  # runtime/starter.py
Self = TypeVar("Self", bound="RunConfig")

# The schema of a whole run, by name: the runtime never imports the actors.
SCHEMA = "ringfence.actors.config:Config"
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_IMPORT = (rf"{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*", "an import path 'module:ATTRIBUTE'")


def setting(default: T, doc: str, **rules: Any) -> T:
    """A scalar field: its default, its one-line doc and its rules, kept in field metadata.

    Rules (``config_tables.RULES``): ``ge``, ``gt``, ``le`` (bounds), ``multiple_of``, ``pattern``
    (``(regex, description)``, matched in full) and ``above`` (a sibling field this value
    must exceed). ``debug`` (a tuple of values, empty for any but the default) marks a
    setting that exists to measure or debug (``config_tables.DEBUG``). A package that may
    not import the runtime (the cache, the scheduler) declares its fields with its own
    two-line copy of this; the loader checks every section's metadata once, whoever wrote
    it (:func:`_check_section`).
    """
    return dataclasses.field(default=default, metadata={"doc": doc, **rules})


def topology_setting(default: str) -> str:
    """The ``runtime.topology`` field with ``default``: a schema's section of ``[runtime]``
    (a subclass of :class:`RuntimeConfig`) declares its own default with it."""
    return setting(
        default,
        "actor topology to launch, 'module:ATTRIBUTE': a Topology, or a function of the config",
        pattern=_IMPORT,
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeConfig:
    """[runtime]: run dirs, logs, rings and the supervisor's clocks."""

    run_dir: str = setting("runs", "parent folder of run dirs")
    log_level: LogLevel = setting("info", "info, or trace for the full protocol trace")
    ring_bytes: int = setting(1 << 20, "bytes of a ring", ge=4096, le=1 << 30, multiple_of=8)
    spin_us: float = setting(50.0, "microseconds a waiter spins before it blocks", ge=0, le=100000)
    wait: Wait = setting(
        "block",
        "block: an idle actor sleeps on its doorbell; poll: the legacy design's pollers, a "
        "1 ms sleep between looks at its inboxes and watermarks (a baseline to measure)",
        debug=("poll",),
    )
    # The run's schema gives the default (a subclass of this section): the runtime names
    # no topology of the actors.
    topology: str = topology_setting("")
    heartbeat_s: float = setting(0.5, "seconds between actor heartbeats", gt=0)
    heartbeat_timeout_s: float = setting(
        10.0,
        "seconds without a heartbeat before an actor counts as dead",
        gt=0,
        above="heartbeat_s",
    )
    ready_timeout_s: float = setting(60.0, "seconds the supervisor waits for ready actors", gt=0)
    stop_timeout_s: float = setting(10.0, "seconds an actor gets to stop before it is killed", gt=0)
    start_method: StartMethod = setting(
        "forkserver",
        "forkserver: children fork from a server that imported their modules once; spawn: "
        "each from a fresh interpreter (a run on CUDA uses spawn unless this is set)",
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ActorPolicy:
    """[actors.<name>]: where one actor runs and how the supervisor restarts it."""

    placement: Placement = setting(
        "spawn",
        "spawn (by the supervisor), external (embedded by a user's process) or hosted (on a "
        "thread of the process of the actor named by host, rank for rank, sharing its fate)",
    )
    host: str = setting(
        "",
        "placement hosted: the actor whose process runs this one (itself spawned, with as "
        "many ranks)",
        pattern=(r"([a-z][a-z0-9_]{0,31})?", "an actor's name"),
    )
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
    # The dotted keys (and tables) a file or ``--set`` wrote, whatever their value: a
    # default that depends on the device yields to these (actors/device_defaults.py). No
    # TOML key; a config built in Python, not loaded, has none. Left out of equality.
    explicit: frozenset[str] = dataclasses.field(
        default=frozenset(), compare=False, repr=False, metadata={EXPLICIT: True}
    )

    def __post_init__(self) -> None:
        actors = types.MappingProxyType(dict(sorted(self.actors.items())))
        object.__setattr__(self, "actors", actors)
        given = dict(self.tools)
        if unknown := given.keys() - self.TOOLS.keys():
            raise TypeError(f"{type(self).__name__} has no tool sections {sorted(unknown)}")
        tools = {
            name: given.get(name) or section_class(path)() for name, path in self.TOOLS.items()
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
        layers = [] if path is None else [read_layer(path)]
        layers += [("--set", nest(*parse_override(text))) for text in overrides]
        written: set[str] = set()
        loaded = resolve(cls, {}, layers, "defaults", written)
        return dataclasses.replace(loaded, explicit=frozenset(written))

    @classmethod
    def loads(cls: type[Self], text: str, source: str = "<string>") -> Self:
        """The defaults, then the TOML document ``text``; errors name ``source``."""
        written: set[str] = set()
        loaded = resolve(
            cls, {}, [(source, parse_toml(source, text.encode()))], "defaults", written
        )
        return dataclasses.replace(loaded, explicit=frozenset(written))

    def with_overrides(self: Self, overrides: Mapping[str, object], source: str = "--set") -> Self:
        """This config with dotted-key ``overrides`` applied in order, validated like a file's;
        its :attr:`explicit` keys and theirs."""
        layers = [(source, nest(key, value, source)) for key, value in overrides.items()]
        written = set(self.explicit)
        changed = resolve(type(self), to_raw(self), layers, "config", written)
        return dataclasses.replace(changed, explicit=frozenset(written))

    def actor(self, name: str) -> ActorPolicy:
        """The policy configured for actor ``name``, or the default policy."""
        return self.actors.get(name, ActorPolicy())

    def section(self, name: str) -> object:
        """The section dataclass of TOML table ``name`` (``"cache"``, ``"cache.storage"``).
        ConfigError for a name no table has, and for ``""``: the whole config is no section."""
        if not name:
            raise ConfigError("a section needs a name: the whole config is no section", key="")
        node: Any = self
        parts = name.split(".")
        for depth, part in enumerate(parts):
            tables = tables_of(type(node))
            if depth == 0 and part in self.tools:
                node = self.tools[part]
                continue
            if part not in tables:
                key = ".".join(parts[: depth + 1])
                prefix = ".".join(parts[:depth])
                choices = [*tables, *self.tools] if depth == 0 else tables
                raise ConfigError(
                    f"{key}: unknown section{suggest(part, choices, prefix)}", key=key
                )
            node = getattr(node, part)
        return node

    def sections(self, cls: type[T]) -> T:
        """``cls`` filled with this config's sections: a dataclass whose fields are sections,
        each named as its top-level table (an actor's settings, ``Actor.config_section``).

        ConfigError naming ``cls.field`` where this config has no such section, TypeError
        where the section is not of the field's type.
        """
        tables = [*tables_of(type(self)), *self.tools]
        hints = typing.get_type_hints(cls)
        found: dict[str, object] = {}
        for f in dataclasses.fields(typing.cast(Any, cls)):
            if f.name not in tables:
                hint = suggest(f.name, tables, "")
                raise ConfigError(
                    f"{cls.__qualname__}.{f.name}: the run's config has no section "
                    f"{f.name!r}{hint}",
                    key=f.name,
                )
            section = self.section(f.name)
            if isinstance(hints[f.name], type) and not isinstance(section, hints[f.name]):
                raise TypeError(
                    f"{cls.__qualname__}.{f.name}: the run's [{f.name}] is a "
                    f"{type(section).__qualname__}, not a {hints[f.name].__qualname__}"
                )
            found[f.name] = section
        return cls(**found)


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
            hint = suggest(name, names, "actors")
            raise ConfigError(f"{where(source, key)}: unknown actor{hint}", key=key)


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
    dump_table(cfg, "", lines)
    return "\n".join(lines) + "\n"

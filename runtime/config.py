"""Run configuration: one TOML file mapped onto frozen dataclasses, with a default for every key.

Precedence, later wins: the built-in defaults, then the file given to :func:`load_config`,
then each ``--set section.key=value`` override in order. The dataclasses below are the one
schema: types come from the annotations (``Literal`` for choices), docs and ranges from
:func:`setting` metadata, and one generic walker validates any table against them. Every
problem raises :class:`ConfigError` whose message starts with where the value came from
(the file path or ``--set``), then the dotted key, e.g. ``--set runtime.spinus: unknown key
(did you mean runtime.spin_us?)``. :func:`dump_config` writes TOML that loads back equal.
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

from ringfence.shm.errors import ConfigError

# ruff: noqa: RUF009 (setting() returns a dataclasses.field(), which ruff cannot see)

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
D = TypeVar("D", bound="DataclassInstance")

Preset = Literal["tiny", "small"]
Dtype = Literal["float32", "bfloat16", "float64"]
Eviction = Literal["write_back", "write_through", "none"]
Backend = Literal["local", "redis", "memory", "none"]
Preemption = Literal["recompute", "swap", "save"]
TransferMode = Literal["fence", "sync"]
LogLevel = Literal["info", "trace"]
Placement = Literal["spawn", "external"]
Restart = Literal["never", "on-failure"]

ACTOR_NAME = r"[a-z][a-z0-9_]{0,31}"  # full match; the <name> of an [actors.<name>] table
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DEVICE = (r"cpu|cuda(:[0-9]+)?", "'cpu', 'cuda' or 'cuda:N'")
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

    Rules: ``ge``, ``gt``, ``le`` (bounds), ``multiple_of``, ``pattern`` (``(regex,
    description)``, matched in full) and ``above`` (a sibling field this value must exceed).
    """
    if unknown := rules.keys() - {"ge", "gt", "le", "multiple_of", "pattern", "above"}:
        raise TypeError(f"unknown setting rules {sorted(unknown)}")
    return dataclasses.field(default=default, metadata={"doc": doc, **rules})


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """[model]: which weights to run, in which dtype, on which device."""

    preset: Preset = setting("tiny", "built-in model preset, used when model.path is empty")
    path: str = setting("", "checkpoint directory; when set it takes precedence over the preset")
    dtype: Dtype = setting("float32", "dtype of the weights and the KV cache")
    device: str = setting("cpu", "torch device: 'cpu', 'cuda' or 'cuda:N'", pattern=_DEVICE)
    seed: int = setting(0, "random seed of the model (preset weights, sampling)", ge=0)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StorageConfig:
    """[cache.storage]: the storage tier below host memory."""

    backend: Backend = setting("local", "storage backend; 'none' disables the storage tier")
    path: str = setting("", "directory of the 'local' backend; empty = <run dir>/storage")
    url: str = setting("", "server URL of the 'redis' backend")
    max_bytes: int = setting(1 << 30, "capacity of the storage tier in bytes", ge=0)
    timeout_s: float = setting(
        2.0, "'redis': the most seconds a connect or a reply may take", gt=0, le=3600
    )
    presence_timeout_s: float = setting(
        0.05,
        "the most seconds the engine waits to learn what the tier holds; later is a miss",
        gt=0,
        le=60,
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CacheConfig:
    """[cache]: KV block size, the pool of each tier and how blocks move down."""

    block_size: int = setting(16, "tokens per KV block", ge=1, le=4096)
    device_blocks: int = setting(512, "KV blocks in the device pool", ge=1)
    host_blocks: int = setting(2048, "KV blocks in the host pool; 0 = no host cache tier", ge=0)
    device_eviction: Eviction = setting(
        "write_back", "device tier: write_back (demote on eviction), write_through or none"
    )
    host_eviction: Eviction = setting("write_back", "host tier, demoting to storage: the same")
    poison_freed: bool = setting(False, "fill freed and swapped-out device blocks with NaN (debug)")
    storage: StorageConfig = dataclasses.field(default_factory=StorageConfig)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SchedConfig:
    """[sched]: batch limits and what preemption does with a sequence's blocks."""

    max_num_seqs: int = setting(16, "most sequences in one batch", ge=1)
    max_batched_tokens: int = setting(512, "most tokens in one step", ge=1)
    preemption: Preemption = setting("recompute", "recompute, swap (to host) or save (to storage)")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TransferConfig:
    """[transfer]: how block copies are ordered against model steps."""

    mode: TransferMode = setting("fence", "fence (asynchronous, ordered by fences) or sync")
    chaos_delay_ms: float = setting(0.0, "random delay per transfer op, in ms (debug)", ge=0)
    skip_fences: bool = setting(
        False, "debug only: executors do not wait for fences (tests show they catch it)"
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RuntimeConfig:
    """[runtime]: run dirs, logs, rings and the supervisor's clocks."""

    run_dir: str = setting("runs", "parent folder of run dirs")
    log_level: LogLevel = setting("info", "info, or trace for the full protocol trace")
    ring_bytes: int = setting(1 << 20, "bytes of a ring", ge=4096, le=1 << 30, multiple_of=8)
    spin_us: float = setting(50.0, "microseconds a waiter spins before it blocks", ge=0, le=100000)
    topology: str = setting(
        _ENGINE, "actor topology to launch, 'module:ATTRIBUTE'", pattern=_IMPORT
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
class DemoConfig:
    """[demo]: the demo pipeline run before the engine exists."""

    messages: int = setting(100000, "messages to send; 0 = stream until stopped", ge=0)
    payload_bytes: int = setting(64, "payload bytes per message", ge=0, le=65536)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HarnessConfig:
    """[harness]: the protocol harness (a scripted engine over random programs)."""

    programs: int = setting(20, "random programs to run, one after another", ge=1)
    ops: int = setting(40, "ops per program (steps, swaps, write-backs, prefetches)", ge=1)
    seed: int = setting(0, "seed of the first program; program k uses seed + k", ge=0)
    check: bool = setting(True, "compare each program with its sequential interpretation")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """[engine]: the workload the engine runs (``launch --workload``), and its shutdown."""

    workload: str = setting(
        "", "a JSON-lines file or synthetic:NAME to run to completion; empty = serve clients"
    )
    requests: int = setting(0, "requests of the workload to run; 0 = all of it", ge=0)
    seed: int = setting(0, "seed of a synthetic workload", ge=0)
    arrivals: bool = setting(True, "honour each request's arrival_s; false = all at once")
    progress: bool = setting(True, "show progress on the terminal during a workload")
    drain_timeout_s: float = setting(
        30.0, "at shutdown, how long to wait for the store lane's writes in flight", ge=0
    )
    max_requests_per_client: int = setting(
        256, "requests one client may have live; more are refused (backpressure)", ge=1
    )


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


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The resolved configuration; each actor receives only its own section.

    ``actors`` is a read-only mapping, sorted by name, over a private copy: the config is
    immutable all the way down. It is left out of the hash (a mapping has none) and pickled
    as a plain dict.
    """

    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    cache: CacheConfig = dataclasses.field(default_factory=CacheConfig)
    sched: SchedConfig = dataclasses.field(default_factory=SchedConfig)
    transfer: TransferConfig = dataclasses.field(default_factory=TransferConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    demo: DemoConfig = dataclasses.field(default_factory=DemoConfig)
    harness: HarnessConfig = dataclasses.field(default_factory=HarnessConfig)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    actors: Mapping[str, ActorPolicy] = dataclasses.field(
        default_factory=lambda: types.MappingProxyType({}),
        hash=False,
    )

    def __post_init__(self) -> None:
        actors = types.MappingProxyType(dict(sorted(self.actors.items())))
        object.__setattr__(self, "actors", actors)

    def __reduce__(self) -> tuple[Any, ...]:
        # A mappingproxy cannot be pickled, and a config travels to spawned actors.
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return functools.partial(Config, **fields | {"actors": dict(self.actors)}), ()

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
            tables = [n for n, tp in _hints(node.__class__).items() if dataclasses.is_dataclass(tp)]
            if part not in tables:
                key = ".".join(parts[: depth + 1])
                prefix = ".".join(parts[:depth])
                raise ConfigError(
                    f"{key}: unknown section{_suggest(part, tables, prefix)}", key=key
                )
            node = getattr(node, part)
        return node


def check_actor_names(cfg: Config, valid: Iterable[str], source: str) -> None:
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
) -> Config:
    """The defaults, then the TOML file at ``path`` (if given), then each override in order."""
    layers = [] if path is None else [_read(path)]
    layers += [("--set", _nest(*parse_override(text))) for text in overrides]
    return _resolve({}, layers, "defaults")


def loads_config(text: str, source: str = "<string>") -> Config:
    """The defaults, then the TOML document ``text``; errors name ``source``."""
    return _resolve({}, [(source, _parse(source, text.encode()))], "defaults")


def with_overrides(cfg: Config, overrides: Mapping[str, object], source: str = "--set") -> Config:
    """``cfg`` with dotted-key ``overrides`` applied in order, validated like a file's."""
    layers = [(source, _nest(key, value, source)) for key, value in overrides.items()]
    return _resolve(_to_raw(cfg), layers, "config")


def dump_config(cfg: Config) -> str:
    """TOML text of every key of ``cfg``, defaults included, each under a ``# doc`` line.

    Sections come in schema order; :func:`loads_config` of the text gives back ``cfg``.
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
    raw: dict[str, Any], layers: Iterable[tuple[str, Mapping[str, Any]]], default: str
) -> Config:
    origin = _Origin(default)
    for source, layer in layers:
        _merge(raw, layer, "", source, origin)
    return _build(Config, raw, "", origin)


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


def _build(cls: type[D], raw: object, key: str, origin: _Origin) -> D:
    """Validate table ``raw`` at dotted ``key`` ("" for the root) against dataclass ``cls``."""
    if not isinstance(raw, dict):
        raise origin.error(f"expected a table, got {_describe(raw)}", key)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in raw:
        if name not in fields:
            raise origin.error(f"unknown key{_suggest(name, fields, key)}", _join(key, name))
    hints = _hints(cls)
    values = {
        name: _value(hints[name], fields[name].metadata, value, _join(key, name), origin)
        for name, value in raw.items()
    }
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
        return {f.name: _to_raw(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {name: _to_raw(value) for name, value in obj.items()}
    return obj


def _dump_table(obj: Any, key: str, lines: list[str]) -> None:
    # TOML puts a table's own keys before any sub-table header, so scalars go first.
    subtables = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) or isinstance(value, Mapping):
            subtables.append((f, value))
        else:
            lines += [f"# {f.metadata['doc']}", f"{_dump_key(f.name)} = {_dump_value(value)}"]
    for f, value in subtables:
        sub = _join(key, _dump_key(f.name))
        tp = _hints(obj.__class__)[f.name]  # a section class, or Mapping[str, section class]
        lines += ["", f"# {(typing.get_args(tp)[1] if isinstance(value, Mapping) else tp).__doc__}"]
        if isinstance(value, Mapping):
            named = [(f"{sub}.{_dump_key(name)}", item) for name, item in value.items()]
        else:
            named = [(sub, value)]
        for i, (path, item) in enumerate(named):
            lines += [""] * (i > 0) + [f"[{path}]"]
            _dump_table(item, path, lines)


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

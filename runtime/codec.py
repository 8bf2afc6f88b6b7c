"""The wire codec: frozen message dataclasses to and from (kind, orjson payload) frames.

A frame's ``kind`` (u32) packs the message class's tag and protocol version as
``tag << TAG_SHIFT | version``; the payload is the orjson encoding of a JSON object
with one key per dataclass field, nested dataclasses as objects and tuples as
arrays, ``bytes`` as lowercase hex strings, keys in field declaration order. A
:class:`Registry` holds the classes of one channel direction. Encoding relies on
orjson's native dataclass support; decoding validates strictly with converter closures
built once, at registration, from the field annotations. Floats must be finite: orjson
writes NaN as null.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import reprlib
import types
import typing
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Literal, NamedTuple, NewType, TypeVar, Union

import orjson

from ringfence.shm.errors import ProtocolError

TAG_SHIFT = 16  # kind bits 16..31 hold the tag
VERSION_MASK = 0xFFFF  # kind bits 0..15 hold the protocol version
TAG_MAX = 0xFFFF  # tags are 1..TAG_MAX; tag 0 is never valid
VERSION_MAX = 0xFFFF  # versions are 1..VERSION_MAX
INT_MIN = -(2**63)  # decoded ints must fit signed or unsigned 64-bit, as orjson encodes
INT_MAX = 2**64 - 1

T = TypeVar("T")
_Conv = Callable[[object], object]  # checks one parsed JSON value, returns the field value
_JSON_NAMES: dict[type, str] = {type(None): "null", bool: "bool", int: "int", float: "float"}
_JSON_NAMES |= {str: "str", list: "array", dict: "object"}
_ABSENT = object()  # marks a key missing from a parsed object


def make_kind(tag: int, version: int) -> int:
    """Pack a tag and version (both 1..0xFFFF, not checked here) into a frame kind."""
    return tag << TAG_SHIFT | version


def split_kind(kind: int) -> tuple[int, int]:
    """Unpack a frame kind into ``(tag, version)``."""
    return kind >> TAG_SHIFT, kind & VERSION_MASK


class _Mismatch(Exception):
    """A parsed value does not fit its annotation; ``path`` collects keys inside-out."""

    def __init__(self, reason: str, *path: str | int) -> None:
        super().__init__(reason)
        self.reason = reason
        # Each enclosing container appends its key on the way out, so the success path
        # never builds a path string.
        self.path: list[str | int] = list(path)


def _expected(what: str, value: object) -> _Mismatch:
    return _Mismatch(f"expected {what}, got {_JSON_NAMES.get(type(value), type(value).__name__)}")


def _int(v: object) -> object:
    if type(v) is not int:
        raise _expected("int", v)
    if not INT_MIN <= v <= INT_MAX:
        raise _Mismatch(f"int {v} is outside [-2**63, 2**64-1]")
    return v


def _fits(ints: list[int]) -> bool:
    return not ints or (min(ints) >= INT_MIN and max(ints) <= INT_MAX)


def _float(v: object) -> object:
    if type(v) is float:
        return v
    if type(v) is int and INT_MIN <= v <= INT_MAX:
        return float(v)  # other JSON writers may send 1.0 as 1
    raise _expected("float", v)


def _scalar(kind: type) -> _Conv:
    def conv(v: object) -> object:
        if type(v) is not kind:
            raise _expected(_JSON_NAMES[kind], v)
        return v

    return conv


_HEX = re.compile(r"(?:[0-9a-f]{2})*")  # what bytes.hex() writes, and nothing else


def _bytes(v: object) -> object:
    if type(v) is not str:
        raise _expected("str of hex", v)
    if not _HEX.fullmatch(v):
        raise _Mismatch(f"expected lowercase hex of whole bytes, got {_VALUES.repr(v)}")
    return bytes.fromhex(v)


def _hex(obj: object) -> str:
    """orjson's hook for the one non-JSON type a message may hold."""
    if type(obj) is bytes:
        return obj.hex()
    raise TypeError(f"Type is not JSON serializable: {type(obj).__name__}")


_SCALARS: dict[object, _Conv] = {int: _int, float: _float, str: _scalar(str), bool: _scalar(bool)}
_SCALARS[type(None)] = _scalar(type(None))
_SCALARS[bytes] = _bytes
_VALUES = reprlib.Repr()


def _items(convs: Iterable[_Conv], v: list[object]) -> tuple[object, ...]:
    out = []
    for i, (conv, x) in enumerate(zip(convs, v, strict=False)):
        try:
            out.append(conv(x))
        except _Mismatch as e:
            e.path.append(i)
            raise
    return tuple(out)


def _tuple_of(item: _Conv) -> _Conv:
    def conv(v: object) -> object:
        if type(v) is not list:
            raise _expected("array", v)
        # Fast path for the common tuple of block ids: checks in C, no call per item.
        if item is _int and list(map(type, v)).count(int) == len(v) and _fits(v):
            return tuple(v)
        return _items(itertools.repeat(item), v)

    return conv


def _fixed_tuple(items: tuple[_Conv, ...]) -> _Conv:
    def conv(v: object) -> object:
        if type(v) is not list or len(v) != len(items):
            got = f"length {len(v)}" if type(v) is list else _JSON_NAMES.get(type(v), "?")
            raise _Mismatch(f"expected array of length {len(items)}, got {got}")
        return _items(items, v)

    return conv


def _dict_of(item: _Conv) -> _Conv:
    def conv(v: object) -> object:
        if type(v) is not dict:
            raise _expected("object", v)
        out = {}
        for k, x in v.items():
            try:
                out[k] = item(x)
            except _Mismatch as e:
                e.path.append(k)
                raise
        return out

    return conv


def _literal(values: tuple[object, ...], where: str) -> _Conv:
    if not values or any(type(a) not in (str, int) for a in values):
        raise TypeError(f"{where}: Literal values must be str or int, got {values!r}")
    allowed = frozenset((type(a), a) for a in values)  # the type keeps True from matching 1

    def conv(v: object) -> object:
        if type(v) in (str, int) and (type(v), v) in allowed:
            return v
        raise _Mismatch(f"expected one of {values!r}, got {reprlib.repr(v)}")

    return conv


def _optional(inner: _Conv) -> _Conv:
    return lambda v: None if v is None else inner(v)


def _show(tp: object) -> str:
    return tp.__name__ if type(tp) is type else repr(tp)


def _converter(tp: object, where: str, seen: frozenset[type]) -> _Conv:
    """Build the decoder of one annotation; ``where`` names it in TypeErrors."""
    while isinstance(tp, NewType):
        tp = tp.__supertype__
    if isinstance(tp, Hashable) and tp in _SCALARS:
        return _SCALARS[tp]
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = args[0] if args[1] is type(None) else args[1]
        return _optional(_converter(inner, where, seen))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _tuple_of(_converter(args[0], where, seen))
    if origin is tuple:
        return _fixed_tuple(tuple(_converter(a, where, seen) for a in args))
    if origin is dict and len(args) == 2 and args[0] is str:
        return _dict_of(_converter(args[1], where, seen))
    if origin is Literal:
        return _literal(args, where)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass_converter(tp, seen, where)
    raise TypeError(
        f"{where}: unsupported annotation {_show(tp)}; use int, float, str, bool, bytes, None, "
        "X | None, tuple[X, ...], tuple[X, Y], dict[str, X], Literal of str/int, a NewType of "
        "these, or a frozen dataclass of these"
    )


def _is_frozen(cls: type) -> bool:
    return bool(getattr(cls, "__dataclass_params__").frozen)  # noqa: B009 - not in typeshed


def _dataclass_converter(cls: type, seen: frozenset[type], where: str) -> _Conv:
    """Build the decoder of a JSON object into ``cls``, checking ``cls`` on the way."""
    if not _is_frozen(cls):
        raise TypeError(f"{where}: {cls.__name__} must be a frozen dataclass")
    if cls in seen:
        raise TypeError(f"{where}: {cls.__name__} contains itself, which JSON cannot")
    try:
        hints = typing.get_type_hints(cls)
    except NameError as e:
        raise TypeError(f"cannot resolve the annotations of {cls.__name__}: {e}") from e
    specs: list[tuple[str, _Conv, Callable[[], object] | None, Callable[[object, object], None]]]
    specs = []
    for f in dataclasses.fields(cls):
        if not f.init:
            raise TypeError(f"{cls.__name__}.{f.name}: init=False fields cannot be decoded")
        convert = _converter(hints[f.name], f"{cls.__name__}.{f.name}", seen | {cls})
        default: Callable[[], object] | None = None
        if f.default is not dataclasses.MISSING:
            default = functools.partial(_same, f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory
        specs.append((f.name, convert, default, _setter(cls, f.name)))
    names = frozenset(spec[0] for spec in specs)
    new = object.__new__
    post_init = getattr(cls, "__post_init__", None)

    def conv(v: object) -> object:
        if type(v) is not dict:
            raise _expected("object", v)
        obj: object = new(cls)
        found = 0
        for name, field_conv, default, store in specs:
            if (x := v.get(name, _ABSENT)) is not _ABSENT:
                found += 1
                try:
                    store(obj, field_conv(x))
                except _Mismatch as e:
                    e.path.append(name)
                    raise
            elif default is None:
                raise _Mismatch("required but missing", name)
            else:
                store(obj, default())
        if found != len(v):  # every known key was found, so the rest are unknown
            extra = next(k for k in v if k not in names)
            raise _Mismatch(f"not a field of {cls.__name__}", extra)
        if post_init is not None:
            try:
                post_init(obj)
            except (TypeError, ValueError) as e:  # a __post_init__ check refused the values
                raise _Mismatch(f"rejected by {cls.__name__}: {e}") from e
        return obj

    return conv


def _same(value: object) -> object:
    return value


def _setter(cls: type, name: str) -> Callable[[object, object], None]:
    """Store a field of a new instance directly through its slot.

    A frozen dataclass's ``__init__`` goes through ``object.__setattr__`` once per field
    and costs about three times as much; the decoder fills the same slots, in the same
    order, then runs ``__post_init__`` as ``__init__`` would.
    """
    slot = getattr(cls, name, None)
    store = getattr(slot, "__set__", None)
    if store is None or not isinstance(slot, types.MemberDescriptorType):
        return lambda obj, value: object.__setattr__(obj, name, value)
    return typing.cast(Callable[[object, object], None], store)


class _Entry(NamedTuple):
    cls: type  # the registered message class
    tag: int  # the wire tag, 1..TAG_MAX
    version: int  # the protocol version, 1..VERSION_MAX
    kind: int  # make_kind(tag, version), precomputed for encode
    where: str  # "registry: tag N (Class vV)", the prefix of every error about it
    decode: _Conv  # checks a parsed JSON object and builds the instance


def _message_problem(cls: object) -> str | None:
    """Why ``cls`` cannot be a top-level message, or None if it can."""
    if not isinstance(cls, type) or not dataclasses.is_dataclass(cls):
        return "is not a dataclass; apply @message above @dataclass"
    if not _is_frozen(cls) or "__slots__" not in vars(cls):
        return "must be @dataclass(frozen=True, slots=True, kw_only=True)"
    if not all(f.kw_only for f in dataclasses.fields(cls)):
        return "must be @dataclass(frozen=True, slots=True, kw_only=True)"
    return None


def _key(key: str | int) -> str:
    """A path key for a message: the payload's own keys may be as long as the frame, and an
    error (or its reply) that quotes one must stay short."""
    return _KEYS.repr(key)


_KEYS = reprlib.Repr()
_KEYS.maxstring = 64


def _field_error(entry: _Entry, e: _Mismatch) -> ProtocolError:
    """Turn a converter's mismatch into the ProtocolError that names its path."""
    if not e.path:
        return ProtocolError(f"{entry.where}: payload: {e.reason}", tag=entry.tag)
    top, *rest = reversed(e.path)
    subscripts = "".join(f"[{_key(key)}]" for key in rest)
    top = str(top)
    named = _key(top)
    message = f"{entry.where}: field {named}{subscripts}: {e.reason}"
    short = top if len(top) <= _KEYS.maxstring else named[1:-1]
    return ProtocolError(message, tag=entry.tag, field=f"{short}{subscripts}")


class Registry:
    """The message classes of one channel direction, keyed by wire tag.

    Registration happens at import time, in the protocol module; afterwards the
    registry is only read, so one instance may be shared by threads. ``verify=True``
    makes :meth:`encode` decode its own output and compare (twice the cost), which
    catches fields holding wrong types before the peer sees them; tests want it.
    """

    def __init__(self, name: str, *, verify: bool = False) -> None:
        self.name = name  # names the channel in every error, e.g. "engine->worker"
        self._verify = verify
        self._by_tag: dict[int, _Entry] = {}
        self._by_cls: dict[type, _Entry] = {}

    def register(self, cls: type[T], *, tag: int, version: int = 1) -> type[T]:
        """Add ``cls`` under ``tag`` and return it unchanged.

        Raises TypeError for a duplicate tag or class, a class that is not a frozen,
        slotted, keyword-only dataclass, or an unsupported field annotation;
        ValueError for a tag or version outside 1..0xFFFF. Nothing is added on error.
        """
        for label, value, limit in (("tag", tag, TAG_MAX), ("version", version, VERSION_MAX)):
            if type(value) is not int:
                raise TypeError(f"{self.name}: {label} must be an int, got {value!r}")
            if not 1 <= value <= limit:
                raise ValueError(f"{self.name}: {label} must be in 1..{limit}, got {value}")
        name = getattr(cls, "__name__", repr(cls))
        if problem := _message_problem(cls):
            raise TypeError(f"{self.name}: {name} {problem}")
        if tag in self._by_tag:
            raise TypeError(f"{self.name}: tag {tag} is taken by {self._by_tag[tag].cls.__name__}")
        if cls in self._by_cls:
            raise TypeError(f"{self.name}: {name} is already registered")
        try:
            decode = _dataclass_converter(cls, frozenset(), name)
        except TypeError as e:
            raise TypeError(f"{self.name}: {e}") from e
        where = f"{self.name}: tag {tag} ({name} v{version})"
        entry = _Entry(cls, tag, version, make_kind(tag, version), where, decode)
        self._by_tag[tag] = self._by_cls[cls] = entry
        return cls

    def tag_of(self, cls: type) -> int:
        """The wire tag ``cls`` is registered under; KeyError if it is not registered here."""
        entry = self._by_cls.get(cls)
        if entry is None:
            raise KeyError(f"{self.name}: {cls.__name__} is not a registered message")
        return entry.tag

    def __contains__(self, cls: object) -> bool:
        return cls in self._by_cls

    def __iter__(self) -> Iterator[type]:
        """The registered classes, in registration order."""
        return iter([entry.cls for entry in self._by_tag.values()])

    def __len__(self) -> int:
        return len(self._by_tag)

    def encode(self, msg: object) -> tuple[int, bytes]:
        """Return ``(kind, payload)`` for ``msg``; does not mutate it.

        Raises ProtocolError if the exact class of ``msg`` is not registered or orjson
        cannot encode a field. Field types are checked only when ``verify`` is set.
        """
        entry = self._by_cls.get(type(msg))
        if entry is None:
            raise ProtocolError(f"{self.name}: {type(msg).__name__} is not a registered message")
        try:
            # Native output is byte-identical to dumping a dict of the fields, with no
            # per-class code; a generated dict builder was faster only by ~0.6 us.
            payload = orjson.dumps(msg, default=_hex)
        except orjson.JSONEncodeError as e:
            raise ProtocolError(f"{entry.where}: cannot encode: {e}", tag=entry.tag) from e
        if self._verify:
            self._check_round_trip(entry, msg, payload)
        return entry.kind, payload

    def _check_round_trip(self, entry: _Entry, msg: object, payload: bytes) -> None:
        back = self.decode(entry.kind, payload)
        for name in (f.name for f in dataclasses.fields(entry.cls)):
            sent, got = getattr(msg, name), getattr(back, name)
            if sent != got:
                message = f"{entry.where}: field {name!r}: {sent!r} decodes as {got!r}"
                raise ProtocolError(message, tag=entry.tag, field=name)

    def decode(self, kind: int, payload: bytes | memoryview) -> object:
        """Parse and validate one frame into a new instance of the registered class.

        Raises ProtocolError, and nothing else, for an unknown tag, a wrong version,
        a payload that is not a JSON object, and a missing, unknown or mistyped field
        at any depth. ``.field`` is then the path: the field name followed by JSON
        subscripts, as in ``fence['x']`` or ``block_ids[3]``.
        """
        tag, version = split_kind(kind)
        entry = self._by_tag.get(tag)
        if entry is None:
            raise ProtocolError(f"{self.name}: unknown tag {tag} (kind {kind:#x})", tag=tag)
        if version != entry.version:
            raise ProtocolError(
                f"{entry.where}: expected version {entry.version}, got {version}", tag=tag
            )
        try:
            value = orjson.loads(payload)
        except orjson.JSONDecodeError as e:
            raise ProtocolError(f"{entry.where}: payload is not valid JSON: {e}", tag=tag) from e
        try:
            return entry.decode(value)
        except _Mismatch as e:
            raise _field_error(entry, e) from None


def message(registry: Registry, *, tag: int, version: int = 1) -> Callable[[type[T]], type[T]]:
    """Class decorator: register an already-dataclass'ed class; see Registry.register."""

    def decorate(cls: type[T]) -> type[T]:
        return registry.register(cls, tag=tag, version=version)

    return decorate

"""Strict decoders built from annotations: a parsed JSON value to a frozen dataclass.

:func:`dataclass_converter` walks a frozen dataclass's field annotations once and returns a
closure that checks a value parsed by orjson and builds the instance, field by field, with
no per-message reflection at decode time. What an annotation may be: int, float, str,
bool, bytes (lowercase hex on the wire), None, ``X | None``, ``tuple[X, ...]``,
``tuple[X, Y]``, ``dict[str, X]``, ``Literal`` of str or int, a NewType of these, or a
frozen dataclass of these. A value that does not fit raises :class:`Mismatch` with the
path of keys that led to it; the codec turns it into the ProtocolError a peer sees.
Pure functions and immutable tables: safe to share between threads.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import reprlib
import types
import typing
from collections.abc import Callable, Hashable, Iterable
from typing import Literal, NewType, Union

INT_MIN = -(2**63)  # decoded ints must fit signed or unsigned 64-bit, as orjson encodes
INT_MAX = 2**64 - 1
Converter = Callable[[object], object]  # checks one parsed JSON value, returns the field value
_JSON_NAMES: dict[type, str] = {type(None): "null", bool: "bool", int: "int", float: "float"}
_JSON_NAMES |= {str: "str", list: "array", dict: "object"}
_ABSENT = object()  # marks a key missing from a parsed object
# A field's name, decoder, default factory (None: required) and slot setter.
_FieldSpec = tuple[str, Converter, Callable[[], object] | None, Callable[[object, object], None]]


class Mismatch(Exception):
    """A parsed value does not fit its annotation; ``path`` collects keys inside-out."""

    def __init__(self, reason: str, *path: str | int) -> None:
        super().__init__(reason)
        self.reason = reason
        # Each enclosing container appends its key on the way out, so the success path
        # never builds a path string.
        self.path: list[str | int] = list(path)


def _expected(what: str, value: object) -> Mismatch:
    return Mismatch(f"expected {what}, got {_JSON_NAMES.get(type(value), type(value).__name__)}")


def _int(v: object) -> object:
    if type(v) is not int:
        raise _expected("int", v)
    if not INT_MIN <= v <= INT_MAX:
        raise Mismatch(f"int {v} is outside [-2**63, 2**64-1]")
    return v


def _fits(ints: list[int]) -> bool:
    return not ints or (min(ints) >= INT_MIN and max(ints) <= INT_MAX)


def _float(v: object) -> object:
    if type(v) is float:
        return v
    if type(v) is int and INT_MIN <= v <= INT_MAX:
        return float(v)  # other JSON writers may send 1.0 as 1
    raise _expected("float", v)


def _scalar(kind: type) -> Converter:
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
        raise Mismatch(f"expected lowercase hex of whole bytes, got {_VALUES.repr(v)}")
    return bytes.fromhex(v)


def hex_default(obj: object) -> str:
    """orjson's hook for the one non-JSON type a message may hold."""
    if type(obj) is bytes:
        return obj.hex()
    raise TypeError(f"Type is not JSON serializable: {type(obj).__name__}")


_SCALARS: dict[object, Converter] = {int: _int, float: _float, bytes: _bytes}
_SCALARS |= {str: _scalar(str), bool: _scalar(bool), type(None): _scalar(type(None))}
_VALUES = reprlib.Repr()


def _items(convs: Iterable[Converter], v: list[object]) -> tuple[object, ...]:
    out = []
    for i, (conv, x) in enumerate(zip(convs, v, strict=False)):
        try:
            out.append(conv(x))
        except Mismatch as e:
            e.path.append(i)
            raise
    return tuple(out)


def _tuple_of(item: Converter) -> Converter:
    def conv(v: object) -> object:
        if type(v) is not list:
            raise _expected("array", v)
        # Fast path for the common tuple of block ids: checks in C, no call per item.
        if item is _int and list(map(type, v)).count(int) == len(v) and _fits(v):
            return tuple(v)
        return _items(itertools.repeat(item), v)

    return conv


def _fixed_tuple(items: tuple[Converter, ...]) -> Converter:
    def conv(v: object) -> object:
        if type(v) is not list or len(v) != len(items):
            got = f"length {len(v)}" if type(v) is list else _JSON_NAMES.get(type(v), "?")
            raise Mismatch(f"expected array of length {len(items)}, got {got}")
        return _items(items, v)

    return conv


def _dict_of(item: Converter) -> Converter:
    def conv(v: object) -> object:
        if type(v) is not dict:
            raise _expected("object", v)
        out = {}
        for k, x in v.items():
            try:
                out[k] = item(x)
            except Mismatch as e:
                e.path.append(k)
                raise
        return out

    return conv


def _literal(values: tuple[object, ...], where: str) -> Converter:
    if not values or any(type(a) not in (str, int) for a in values):
        raise TypeError(f"{where}: Literal values must be str or int, got {values!r}")
    allowed = frozenset((type(a), a) for a in values)  # the type keeps True from matching 1

    def conv(v: object) -> object:
        if type(v) in (str, int) and (type(v), v) in allowed:
            return v
        raise Mismatch(f"expected one of {values!r}, got {reprlib.repr(v)}")

    return conv


def _optional(inner: Converter) -> Converter:
    return lambda v: None if v is None else inner(v)


def _show(tp: object) -> str:
    return tp.__name__ if type(tp) is type else repr(tp)


def _converter(tp: object, where: str, seen: frozenset[type]) -> Converter:
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
        return dataclass_converter(tp, seen, where)
    raise TypeError(
        f"{where}: unsupported annotation {_show(tp)}; use int, float, str, bool, bytes, None, "
        "X | None, tuple[X, ...], tuple[X, Y], dict[str, X], Literal of str/int, a NewType of "
        "these, or a frozen dataclass of these"
    )


def holds_bytes(tp: object) -> bool:
    """Whether ``bytes`` appears anywhere in the annotation ``tp`` (a dataclass: in any field,
    at any depth): msgspec reads bytes as base64, where this codec writes hex."""
    while isinstance(tp, NewType):
        tp = tp.__supertype__
    if tp is bytes:
        return True
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return any(holds_bytes(hint) for hint in typing.get_type_hints(tp).values())
    return any(holds_bytes(arg) for arg in typing.get_args(tp) if arg is not Ellipsis)


def is_frozen(cls: type) -> bool:
    return bool(getattr(cls, "__dataclass_params__").frozen)  # noqa: B009 - not in typeshed


def dataclass_converter(cls: type, seen: frozenset[type], where: str) -> Converter:
    """Build the decoder of a JSON object into ``cls``, checking ``cls`` on the way.

    ``seen``: the dataclasses enclosing this one (a class that contains itself is refused);
    ``where`` prefixes every TypeError, raised for a class that is not frozen, a field with
    ``init=False`` or an unsupported annotation. The decoder raises :class:`Mismatch`.
    """
    if not is_frozen(cls):
        raise TypeError(f"{where}: {cls.__name__} must be a frozen dataclass")
    if cls in seen:
        raise TypeError(f"{where}: {cls.__name__} contains itself, which JSON cannot")
    try:
        hints = typing.get_type_hints(cls)
    except NameError as e:
        raise TypeError(f"cannot resolve the annotations of {cls.__name__}: {e}") from e
    specs: list[
        tuple[str, Converter, Callable[[], object] | None, Callable[[object, object], None]]
    ]
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
                except Mismatch as e:
                    e.path.append(name)
                    raise
            elif default is None:
                raise Mismatch("required but missing", name)
            else:
                store(obj, default())
        if found != len(v):  # every known key was found, so the rest are unknown
            extra = next(k for k in v if k not in names)
            raise Mismatch(f"not a field of {cls.__name__}", extra)
        if post_init is not None:
            try:
                post_init(obj)
            except (TypeError, ValueError) as e:  # a __post_init__ check refused the values
                raise Mismatch(f"rejected by {cls.__name__}: {e}") from e
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

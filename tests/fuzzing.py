"""Hypothesis strategies for fuzzing an inbox: frames a peer could put on a ring, made from
the messages of the ring's codec registry and then broken in every way the wire allows.

:func:`frames` draws one :class:`Fuzz`: a frame kind and payload, how it was made, and a
fragment that the codec's ``ProtocolError`` must contain when the frame cannot be decoded.
The payload starts as a JSON object shaped like a registered message (:func:`json_for`
follows the field annotations, as the codec does, with values meant to hurt: negative,
zero, 64-bit edges, block ids just past small pools, repeated ids, giant lists, long and
odd strings), and is then left whole (a message that decodes but is wrong in its fields:
the handler's checks are what is fuzzed) or broken: random bytes, truncated, a field
dropped, added or of the wrong type at any depth, an int beyond 64 bits, a JSON value that
is not an object, deep nesting, a wrong protocol version, an unknown tag, a frame near the
ring's size limit. The codec is the oracle of what decodes: :func:`decode` says what a
reader makes of a frame, so a test asserts the actor answered exactly that.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, NewType, TypeVar, Union

import orjson
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ringfence.runtime.codec import (
    TAG_MAX,
    VERSION_MAX,
    Registry,
    make_kind,
    split_kind,
)
from ringfence.runtime.converters import INT_MAX, INT_MIN
from ringfence.runtime.messages import RESERVED_TAG, RUNTIME
from ringfence.shm.errors import ProtocolError

T = TypeVar("T")
WRAP = 0xFFFFFFFF  # a ring frame's kind is a u32 below the wrap marker
SMALL_POOL = 48  # block ids and counts drawn around the pools the fuzz rigs use
EDGE_INTS = (0, 1, -1, 2, 2**31 - 1, 2**31, 2**32, 2**40, 2**53 + 1, 2**63 - 1, INT_MIN, INT_MAX)


class Fuzz(NamedTuple):
    """One fuzzed frame."""

    kind: int  # the frame kind (tag << 16 | version)
    payload: bytes
    how: str  # how it was made: "as generated", "field 'step' dropped", "random bytes", ...
    names: str  # what the ProtocolError of an undecodable frame must contain ("" if anything)

    def __repr__(self) -> str:  # a failing example's report shows the head of a big payload
        head = self.payload if len(self.payload) <= 160 else self.payload[:160] + b"..."
        return f"Fuzz({self.kind:#x}, {head!r} [{len(self.payload)} bytes], {self.how!r})"


def decode(registry: Registry, kind: int, payload: bytes) -> object:
    """What a ring inbox makes of a frame: the message, or the ProtocolError it fails with
    (runtime tags are decoded with the runtime registry, as ``RingInbox`` does)."""
    reader = RUNTIME if split_kind(kind)[0] >= RESERVED_TAG else registry
    try:
        return reader.decode(kind, payload)
    except ProtocolError as e:
        return e


# Values. Ints lean to the edges and to the small numbers pools and lanes use, so that
# decodable messages name blocks just inside and just outside the pools, repeat them,
# and carry op numbers around the lanes' watermarks.
ints = st.one_of(
    st.sampled_from(EDGE_INTS),
    st.integers(-2, SMALL_POOL + 2),
    st.integers(INT_MIN, INT_MAX),
)
floats = st.one_of(
    st.sampled_from((0.0, -0.0, -1.0, 0.5, 1e-300, 1e300, -1e300)),
    st.floats(allow_nan=False, allow_infinity=False),
)
texts = st.one_of(
    st.sampled_from(("", "x", "0" * 32, "zz" * 16, "\u0000", "é", "\U0001f600", "a/b")),
    st.text(max_size=24),
)


def _giant(item: st.SearchStrategy[Any]) -> st.SearchStrategy[list[Any]]:
    """Lists of 2,000 to 40,000 items, built by repetition: cheap to draw, big on the wire."""
    return st.builds(lambda n, x: [x] * n, st.integers(2_000, 40_000), item)


def json_for(tp: object, depth: int = 0) -> st.SearchStrategy[Any]:
    """JSON values for annotation ``tp`` (the annotations the codec supports), hurtful ones."""
    while isinstance(tp, NewType):
        tp = tp.__supertype__
    if tp is int:
        return ints
    if tp is float:
        return floats
    if tp is str:
        return texts
    if tp is bytes:  # the codec's hex: mostly well formed, sometimes any text
        return st.one_of(st.binary(max_size=24).map(bytes.hex), texts)
    if tp is bool:
        return st.booleans()
    if tp is type(None):
        return st.none()
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return st.one_of(*(json_for(a, depth) for a in args))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = json_for(args[0], depth + 1)
        lists = st.lists(item, max_size=4 if depth else 8)
        return lists if depth else st.one_of(lists, lists, lists, _giant(item))
    if origin is tuple:
        return st.tuples(*(json_for(a, depth + 1) for a in args)).map(list)
    if origin is dict:
        return st.dictionaries(texts, json_for(args[1], depth + 1), max_size=4)
    if origin is Literal:
        return st.sampled_from(args)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return object_for(tp, depth + 1)
    raise TypeError(f"no JSON strategy for {tp!r}")


# Fields whose fuzzed values a test must not let an actor act on: a KV handle's CUDA IPC
# record is unpickled by open_kv (a DeviceTier is trusted input), so it stays empty.
PINNED = {"cuda_ipc": ""}


@functools.cache
def object_for(cls: type, depth: int = 0) -> st.SearchStrategy[dict[str, Any]]:
    """A JSON object with one key per field of dataclass ``cls``, each from :func:`json_for`."""
    hints = typing.get_type_hints(cls)
    fields = {
        f.name: st.just(PINNED[f.name]) if f.name in PINNED else json_for(hints[f.name], depth)
        for f in dataclasses.fields(cls)
    }
    return st.fixed_dictionaries(fields)


def messages_json(registry: Registry) -> st.SearchStrategy[tuple[int, dict[str, Any]]]:
    """``(kind, object)`` of any class of ``registry``, shaped like it, values hurtful."""
    return st.one_of(
        [st.tuples(st.just(kind_of(registry, cls)), object_for(cls)) for cls in registry]
    )


def kind_of(registry: Registry, cls: type) -> int:
    """The frame kind ``registry`` encodes ``cls`` with (its tag and version)."""
    return registry._by_cls[cls].kind


# Breaking a message. Each mutation takes the kind and the object and returns a Fuzz.

_Mutation = Callable[[st.DrawFn, int, dict[str, Any]], Fuzz]


def _paths(value: Any, path: tuple[str | int, ...] = ()) -> list[tuple[str | int, ...]]:
    """Every position inside a JSON value (the root excluded), parents before children."""
    found: list[tuple[str | int, ...]] = []
    items = value.items() if isinstance(value, dict) else enumerate(value[:4]) if isinstance(
        value, list) else ()  # fmt: skip
    for key, child in items:
        found.append((*path, key))
        found += _paths(child, (*path, key))
    return found


def _set(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    """A copy of ``root`` with the value at ``path`` replaced."""
    copy = orjson.loads(orjson.dumps(root))
    node = copy
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return typing.cast(dict[str, Any], copy)


def _field(path: tuple[str | int, ...]) -> str:
    return repr(str(path[0]))


def _as_is(draw: st.DrawFn, kind: int, obj: dict[str, Any]) -> Fuzz:
    return Fuzz(kind, orjson.dumps(obj), "as generated", "")


def _dropped(draw: st.DrawFn, kind: int, obj: dict[str, Any]) -> Fuzz:
    if not obj:
        return _as_is(draw, kind, obj)
    name = draw(st.sampled_from(sorted(obj)))
    rest = {k: v for k, v in obj.items() if k != name}
    return Fuzz(kind, orjson.dumps(rest), f"field {name!r} dropped", "")


def _extra(draw: st.DrawFn, kind: int, obj: dict[str, Any]) -> Fuzz:
    key = draw(st.text(min_size=1, max_size=12).filter(lambda k: k not in obj))
    value = draw(st.one_of(ints, texts, st.none(), st.lists(ints, max_size=3)))
    return Fuzz(kind, orjson.dumps({**obj, key: value}), f"extra field {key!r}", "")


_WRONG_TYPES = st.one_of(
    st.sampled_from((None, True, "7", 1.5, [], {}, [[1]], {"x": 1})),
    texts,
    st.integers(INT_MIN, INT_MAX),
)


def _retyped(draw: st.DrawFn, kind: int, obj: dict[str, Any]) -> Fuzz:
    paths = _paths(obj)
    if not paths:
        return _as_is(draw, kind, obj)
    path = draw(st.sampled_from(paths))
    value = draw(_WRONG_TYPES)
    return Fuzz(kind, orjson.dumps(_set(obj, path, value)), f"{list(path)} = {value!r}", "")


def _beyond_64_bits(draw: st.DrawFn, kind: int, obj: dict[str, Any]) -> Fuzz:
    paths = _paths(obj)
    if not paths:
        return _as_is(draw, kind, obj)
    path = draw(st.sampled_from(paths))
    big = draw(st.sampled_from((INT_MAX + 1, INT_MIN - 1, 10**30, -(10**40))))
    text = orjson.dumps(_set(obj, path, "\x00BIG\x00")).replace(b'"\\u0000BIG\\u0000"', b"%d" % big)
    return Fuzz(kind, text, f"{list(path)} = {big}", "")


def _random_bytes(draw: st.DrawFn, kind: int, obj: dict[str, Any]) -> Fuzz:
    payload = draw(st.binary(max_size=64))
    return Fuzz(kind, payload, "random bytes", "")


def _truncated(draw: st.DrawFn, kind: int, obj: dict[str, Any]) -> Fuzz:
    whole = orjson.dumps(obj)
    cut = draw(st.integers(0, len(whole) - 1))
    return Fuzz(kind, whole[:cut], f"truncated at {cut} of {len(whole)}", "not valid JSON")


def _not_an_object(draw: st.DrawFn, kind: int, obj: dict[str, Any]) -> Fuzz:
    value = draw(st.sampled_from(([], [obj], "x", 0, None, True, 1.5)))
    return Fuzz(kind, orjson.dumps(value), f"payload {value!r:.40}", "payload: expected object")


def _not_json(draw: st.DrawFn, kind: int, obj: dict[str, Any]) -> Fuzz:
    payload = draw(
        st.sampled_from(
            (
                b"",
                b"{",
                b"NaN",
                b'{"step": NaN}',
                b'{"step": Infinity}',
                b'{"a": "\xff\xfe"}',
                b"[" * 2000 + b"]" * 2000,  # deeper than any JSON reader's limit
                b"{} {}",
                b"\x00" * 16,
            )
        )
    )
    return Fuzz(kind, payload, f"payload {payload[:24]!r}", "not valid JSON")


def _wrong_version(draw: st.DrawFn, kind: int, obj: dict[str, Any]) -> Fuzz:
    tag, version = split_kind(kind)
    other = draw(st.integers(0, VERSION_MAX).filter(lambda v: v != version))
    return Fuzz(make_kind(tag, other), orjson.dumps(obj), f"version {other}", "version")


def _unknown_tag(draw: st.DrawFn, kind: int, obj: dict[str, Any]) -> Fuzz:
    # Any u32 but the one a ring keeps for its wrap marker, which no writer may put.
    tag, version = draw(
        st.tuples(st.integers(0, TAG_MAX), st.integers(0, VERSION_MAX)).filter(
            lambda tv: make_kind(*tv) != WRAP
        )
    )
    return Fuzz(make_kind(tag, version), orjson.dumps(obj), f"kind tag {tag} v{version}", "")


def _huge(draw: st.DrawFn, kind: int, obj: dict[str, Any]) -> Fuzz:
    """Near the frame size limit: a giant string in a new key, or in an existing one."""
    size = draw(st.sampled_from((16_000, 60_000, 120_000)))
    key = draw(st.sampled_from(["x" * size, *sorted(obj)]))
    value = "y" * size
    return Fuzz(kind, orjson.dumps({**obj, key: value}), f"{size}-byte string in {key[:8]!r}", "")


MUTATIONS: dict[str, _Mutation] = {
    "as_is": _as_is,
    "dropped": _dropped,
    "extra": _extra,
    "retyped": _retyped,
    "beyond_64_bits": _beyond_64_bits,
    "random_bytes": _random_bytes,
    "truncated": _truncated,
    "not_an_object": _not_an_object,
    "not_json": _not_json,
    "wrong_version": _wrong_version,
    "unknown_tag": _unknown_tag,
    "huge": _huge,
}


@st.composite
def frames(
    draw: st.DrawFn,
    registry: Registry,
    *,
    mutations: tuple[str, ...] = tuple(MUTATIONS),
    max_payload: int = (1 << 19) - 16,  # the limit of a ring of the default 1 MiB
) -> Fuzz:
    """One fuzzed frame for an inbox decoded with ``registry`` (see the module docstring).

    ``mutations`` picks from :data:`MUTATIONS` ("as_is": a decodable-looking message with
    hurtful values). Payloads stay within ``max_payload`` (the ring's limit).
    """
    kind, obj = draw(messages_json(registry))
    fuzz = MUTATIONS[draw(st.sampled_from(mutations))](draw, kind, obj)
    if len(fuzz.payload) > max_payload:
        fuzz = Fuzz(fuzz.kind, fuzz.payload[:max_payload], f"{fuzz.how}, cut to fit", "")
    return fuzz


# Running a fuzz test: a short form in CI, a long soak.

# Hypothesis prints the seed and a reproduction blob of any failure. No shrinking: an
# example is a live actor's history, slow to replay many times over; the failing example
# is printed as found. One rig (a live actor) serves every example, as a run would. No
# example database: every fuzz test runs the same inner function (run_examples), so saved
# examples of one test would be replayed into the others.
FUZZ_SETTINGS = settings(
    deadline=None,
    database=None,
    print_blob=True,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
        HealthCheck.large_base_example,
    ],
)


class Form(NamedTuple):
    """How much a fuzz test does: ``examples`` Hypothesis examples of up to ``batches``
    batches of up to ``batch`` frames each, and at least ``frames`` frames in all."""

    examples: int
    batches: int
    batch: int
    frames: int

    @property
    def settings(self) -> settings:
        return settings(FUZZ_SETTINGS, max_examples=self.examples)


def run_examples(form: Form, strategy: st.SearchStrategy[T], body: Callable[[T], int]) -> int:
    """Run ``body`` on each example Hypothesis draws from ``strategy``; the sum of what it
    returned (the frames it put). Asserts the sum reaches ``form.frames``."""
    total = [0]

    @form.settings
    @given(strategy)
    def each(example: T) -> None:
        total[0] += body(example)

    each()
    assert total[0] >= form.frames, f"only {total[0]} fuzzed frames, {form.frames} wanted"
    return total[0]

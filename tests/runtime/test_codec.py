"""Tests of the wire codec: round trips, strict decoding, error messages, registration."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, NewType, Optional

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ringfence.runtime.codec import (
    TAG_SHIFT,
    Registry,
    make_kind,
    message,
    split_kind,
)
from ringfence.runtime.converters import INT_MAX, INT_MIN, hex_default
from ringfence.shm.errors import ProtocolError

# Hypothesis prints a reproduction blob with any failure, which stands in for the seed.
FAST = settings(
    max_examples=150,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)

BlockId = NewType("BlockId", int)
Mode = Literal["prefill", "decode", 3]


@dataclass(frozen=True, slots=True, kw_only=True)
class Span:
    start: BlockId  # first block of the span
    blocks: tuple[BlockId, ...]  # the blocks, in order


@dataclass(kw_only=True)
class MutableSpan:
    start: int  # not frozen, so no message may hold it


@dataclass(frozen=True, slots=True, kw_only=True)
class Node:
    child: Node | None = None  # recursive, so no message may hold it


REG = Registry("engine->worker", verify=True)


@message(REG, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    step: int  # lane number s
    epoch: int
    block_ids: tuple[int, ...]
    fence: dict[str, int]
    note: str | None = None


@message(REG, tag=2, version=3)
@dataclass(frozen=True, slots=True, kw_only=True)
class Rich:
    count: int
    ratio: float
    name: str
    flag: bool
    nothing: None
    maybe: int | None
    legacy: Optional[str]  # noqa: UP045 - the typing spelling must work too
    ids: tuple[BlockId, ...]
    pair: tuple[int, str]
    table: dict[str, float]
    mode: Mode
    span: Span
    spans: tuple[Span, ...]
    nested_opt: Span | None = None
    deep: dict[str, tuple[int | None, ...]] = dataclasses.field(default_factory=dict)


STEP_KIND = make_kind(1, 1)
RICH_KIND = make_kind(2, 3)


def make_step_plan(**overrides: Any) -> StepPlan:
    fields: dict[str, Any] = {"step": 7, "epoch": 2, "block_ids": (3, 4, 5), "fence": {"x": 1}}
    return StepPlan(**(fields | overrides))


def make_span(start: int, *blocks: int) -> Span:
    return Span(start=BlockId(start), blocks=tuple(BlockId(b) for b in blocks))


def make_rich(**overrides: Any) -> Rich:
    fields: dict[str, Any] = {
        "count": -5,
        "ratio": 0.25,
        "name": "héllo",
        "flag": True,
        "nothing": None,
        "maybe": 9,
        "legacy": None,
        "ids": (BlockId(1), BlockId(2**64 - 1)),
        "pair": (-(2**63), "b"),
        "table": {"k": 1.5},
        "mode": 3,
        "span": Span(start=BlockId(0), blocks=(BlockId(8),)),
        "spans": (make_span(1), make_span(2, 5, 6)),
        "nested_opt": make_span(4, 4),
        "deep": {"a": (1, None, 3)},
    }
    return Rich(**(fields | overrides))


def step_json(**changes: Any) -> dict[str, Any]:
    """The JSON object of make_step_plan(), with keys set (or removed, for ...)."""
    obj = orjson.loads(REG.encode(make_step_plan())[1])
    for key, value in changes.items():
        if value is ...:
            del obj[key]
        else:
            obj[key] = value
    return obj


def rich_json(**changes: Any) -> dict[str, Any]:
    obj = orjson.loads(REG.encode(make_rich())[1])
    obj.update(changes)
    return obj


def decode_error(kind: int, payload: bytes | dict[str, Any]) -> ProtocolError:
    """The ProtocolError that decoding ``payload`` (bytes, or an object to dump) raises."""
    if isinstance(payload, dict):
        payload = orjson.dumps(payload)
    with pytest.raises(ProtocolError) as info:
        REG.decode(kind, payload)
    return info.value


# Round trips


def test_a_rich_message_round_trips_to_an_equal_message_with_tuples_not_lists():
    msg = make_rich()
    kind, payload = REG.encode(msg)
    back = REG.decode(kind, payload)
    assert kind == RICH_KIND
    assert back == msg
    assert type(back) is Rich
    assert type(back.ids) is tuple
    assert type(back.pair) is tuple
    assert type(back.spans) is tuple
    assert type(back.spans[1]) is Span
    assert type(back.spans[1].blocks) is tuple
    assert type(back.deep["a"]) is tuple


def test_the_payload_is_a_json_object_of_the_fields_in_declaration_order():
    kind, payload = REG.encode(make_step_plan(note="hi"))
    assert kind == 1 << 16 | 1
    assert payload == b'{"step":7,"epoch":2,"block_ids":[3,4,5],"fence":{"x":1},"note":"hi"}'


def test_nested_dataclasses_are_encoded_as_objects():
    obj = orjson.loads(REG.encode(make_rich())[1])
    assert obj["span"] == {"start": 0, "blocks": [8]}
    assert obj["nested_opt"] == {"start": 4, "blocks": [4]}


def test_a_kind_packs_the_tag_above_the_version():
    assert TAG_SHIFT == 16
    assert make_kind(2, 3) == 0x0002_0003
    assert split_kind(0xFFFF_FFFF) == (0xFFFF, 0xFFFF)
    assert split_kind(make_kind(40, 7)) == (40, 7)


def test_a_memoryview_payload_decodes_like_bytes():
    kind, payload = REG.encode(make_rich())
    assert REG.decode(kind, memoryview(payload)) == make_rich()


def test_a_field_with_a_default_may_be_omitted():
    assert REG.decode(STEP_KIND, orjson.dumps(step_json(note=...))) == make_step_plan()
    obj = rich_json()
    del obj["deep"], obj["nested_opt"]
    assert REG.decode(RICH_KIND, orjson.dumps(obj)) == make_rich(deep={}, nested_opt=None)
    first, second = (REG.decode(RICH_KIND, orjson.dumps(obj)) for _ in range(2))
    assert isinstance(first, Rich) and isinstance(second, Rich)
    assert first.deep is not second.deep  # the default factory runs once per decode


def test_a_decoded_message_is_as_frozen_as_a_constructed_one():
    back = REG.decode(STEP_KIND, orjson.dumps(step_json()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.step = 8  # type: ignore[attr-defined]


def test_an_int_is_accepted_for_a_float_field_and_becomes_a_float():
    back = REG.decode(RICH_KIND, orjson.dumps(rich_json(ratio=2, table={"k": -1})))
    assert isinstance(back, Rich)
    assert type(back.ratio) is float
    assert back.ratio == 2.0
    assert type(back.table["k"]) is float


def test_ints_at_the_64_bit_edges_decode():
    payload = orjson.dumps(step_json(block_ids=[INT_MIN, INT_MAX], step=INT_MAX))
    back = REG.decode(STEP_KIND, payload)
    assert back == make_step_plan(block_ids=(-(2**63), 2**64 - 1), step=2**64 - 1)


@pytest.mark.parametrize("literal", [b"18446744073709551616", b"-9223372036854775809"])
def test_an_int_one_beyond_64_bits_is_a_protocol_error_that_names_the_field(literal):
    payload = orjson.dumps(step_json(step=0)).replace(b'"step":0', b'"step":' + literal)
    err = decode_error(STEP_KIND, payload)
    assert "engine->worker: tag 1 (StepPlan v1): field 'step': expected int" in str(err)
    assert err.field == "step"
    payload = orjson.dumps(step_json(block_ids=[0])).replace(b"[0]", b"[1," + literal + b"]")
    assert decode_error(STEP_KIND, payload).field == "block_ids[1]"


ints = st.integers(INT_MIN, INT_MAX)
floats = st.floats(allow_nan=False, allow_infinity=False)
texts = st.text(max_size=8)
spans = st.builds(Span, start=ints.map(BlockId), blocks=st.lists(ints, max_size=4).map(tuple))
rich_messages = st.builds(
    Rich,
    count=ints,
    ratio=floats,
    name=texts,
    flag=st.booleans(),
    nothing=st.none(),
    maybe=st.none() | ints,
    legacy=st.none() | texts,
    ids=st.lists(ints.map(BlockId), max_size=6).map(tuple),
    pair=st.tuples(ints, texts),
    table=st.dictionaries(texts, floats, max_size=3),
    mode=st.sampled_from(["prefill", "decode", 3]),
    span=spans,
    spans=st.lists(spans, max_size=3).map(tuple),
    nested_opt=st.none() | spans,
    deep=st.dictionaries(texts, st.lists(st.none() | ints, max_size=3).map(tuple), max_size=3),
)


@FAST
@given(msg=rich_messages)
def test_any_generated_rich_message_survives_encode_then_decode(msg):
    kind, payload = REG.encode(msg)
    assert REG.decode(kind, payload) == msg


# Decode errors


def test_an_unknown_tag_is_a_protocol_error_that_names_the_registry_and_tag():
    err = decode_error(make_kind(9, 1), b"{}")
    assert str(err) == "engine->worker: unknown tag 9 (kind 0x90001)"
    assert err.tag == 9
    assert err.field is None


def test_a_known_tag_with_the_wrong_version_names_both_versions():
    err = decode_error(make_kind(1, 3), REG.encode(make_step_plan())[1])
    assert str(err) == "engine->worker: tag 1 (StepPlan v1): expected version 1, got 3"
    assert err.tag == 1


def test_a_payload_that_is_not_json_is_a_protocol_error():
    err = decode_error(STEP_KIND, b'{"step": 1,')
    assert str(err).startswith("engine->worker: tag 1 (StepPlan v1): payload is not valid JSON: ")
    assert err.tag == 1


@pytest.mark.parametrize(("payload", "got"), [(b"[1]", "array"), (b'"x"', "str"), (b"0", "int")])
def test_a_payload_that_is_not_a_json_object_is_a_protocol_error(payload, got):
    err = decode_error(RICH_KIND, payload)
    assert str(err) == f"engine->worker: tag 2 (Rich v3): payload: expected object, got {got}"
    assert err.field is None


def test_a_missing_field_is_a_protocol_error_that_names_it():
    err = decode_error(STEP_KIND, step_json(epoch=...))
    assert str(err) == "engine->worker: tag 1 (StepPlan v1): field 'epoch': required but missing"
    assert (err.tag, err.field) == (1, "epoch")


def test_an_extra_field_is_a_protocol_error_that_names_it():
    err = decode_error(STEP_KIND, step_json(bogus=1))
    assert str(err) == "engine->worker: tag 1 (StepPlan v1): field 'bogus': not a field of StepPlan"
    assert err.field == "bogus"


def test_a_missing_or_extra_field_in_a_nested_object_names_its_path():
    err = decode_error(RICH_KIND, rich_json(span={"start": 1}))
    assert str(err).endswith("field 'span'['blocks']: required but missing")
    err = decode_error(RICH_KIND, rich_json(spans=[{"start": 1, "blocks": [], "z": 0}]))
    assert str(err).endswith("field 'spans'[0]['z']: not a field of Span")
    assert err.field == "spans[0]['z']"


def test_the_example_from_the_design_reads_exactly():
    err = decode_error(STEP_KIND, step_json(fence={"x": "one"}))
    expected = "engine->worker: tag 1 (StepPlan v1): field 'fence'['x']: expected int, got str"
    assert str(err) == expected
    assert (err.tag, err.field) == (1, "fence['x']")


WRONG_TYPES = [
    ({"count": True}, "count", "expected int, got bool"),
    ({"count": 1.0}, "count", "expected int, got float"),
    ({"count": "1"}, "count", "expected int, got str"),
    ({"ratio": False}, "ratio", "expected float, got bool"),
    ({"ratio": None}, "ratio", "expected float, got null"),
    ({"flag": 1}, "flag", "expected bool, got int"),
    ({"name": 5}, "name", "expected str, got int"),
    ({"nothing": 0}, "nothing", "expected null, got int"),
    ({"maybe": "x"}, "maybe", "expected int, got str"),
    ({"legacy": []}, "legacy", "expected str, got array"),
    ({"ids": {"a": 1}}, "ids", "expected array, got object"),
    ({"ids": [1, 2, False]}, "ids[2]", "expected int, got bool"),
    ({"pair": [1, "a", 2]}, "pair", "expected array of length 2, got length 3"),
    ({"pair": "ab"}, "pair", "expected array of length 2, got str"),
    ({"pair": [1, 2]}, "pair[1]", "expected str, got int"),
    ({"table": [1.0]}, "table", "expected object, got array"),
    ({"table": {"k": "1.5"}}, "table['k']", "expected float, got str"),
    ({"mode": "train"}, "mode", "expected one of ('prefill', 'decode', 3), got 'train'"),
    ({"mode": True}, "mode", "expected one of ('prefill', 'decode', 3), got True"),
    ({"mode": "3"}, "mode", "expected one of ('prefill', 'decode', 3), got '3'"),
    ({"span": [0, []]}, "span", "expected object, got array"),
    ({"span": {"start": 1.5, "blocks": []}}, "span['start']", "expected int, got float"),
    (
        {"spans": [{"start": 1, "blocks": [2, "3"]}]},
        "spans[0]['blocks'][1]",
        "expected int, got str",
    ),
    (
        {"nested_opt": {"start": None, "blocks": []}},
        "nested_opt['start']",
        "expected int, got null",
    ),
    ({"deep": {"a": [1, None, 2.5]}}, "deep['a'][2]", "expected int, got float"),
]


@pytest.mark.parametrize(("changes", "path", "reason"), WRONG_TYPES)
def test_a_wrong_type_at_any_depth_is_a_protocol_error_that_names_the_field_path(
    changes, path, reason
):
    err = decode_error(RICH_KIND, rich_json(**changes))
    top, bracket, rest = path.partition("[")
    quoted = f"{top!r}{bracket}{rest}"
    assert str(err) == f"engine->worker: tag 2 (Rich v3): field {quoted}: {reason}"
    assert (err.tag, err.field) == (2, path)


def test_a_value_the_class_itself_rejects_is_a_protocol_error():
    reg = Registry("r")

    @message(reg, tag=1)
    @dataclass(frozen=True, slots=True, kw_only=True)
    class Window:
        low: int
        high: int

        def __post_init__(self):
            if self.low > self.high:
                raise ValueError("low above high")

    with pytest.raises(ProtocolError) as info:
        reg.decode(make_kind(1, 1), b'{"low": 2, "high": 1}')
    assert str(info.value) == "r: tag 1 (Window v1): payload: rejected by Window: low above high"


# Encode errors


def test_encoding_an_unregistered_class_is_a_protocol_error():
    with pytest.raises(ProtocolError, match=r"^engine->worker: Span is not a registered message$"):
        REG.encode(Span(start=BlockId(1), blocks=()))
    with pytest.raises(ProtocolError, match="dict is not a registered message"):
        REG.encode({"step": 1})


def test_encoding_a_value_orjson_rejects_is_a_protocol_error():
    with pytest.raises(ProtocolError, match=r"^engine->worker: tag 1 \(StepPlan v1\): cannot enc"):
        REG.encode(make_step_plan(fence={1: 2}))
    with pytest.raises(ProtocolError, match="cannot encode: Integer exceeds 64-bit range"):
        REG.encode(make_step_plan(step=2**64))


def test_a_verifying_registry_rejects_a_field_of_the_wrong_type_on_encode():
    with pytest.raises(ProtocolError, match=r"field 'step': expected int, got bool") as info:
        REG.encode(make_step_plan(step=True))
    assert info.value.field == "step"
    with pytest.raises(ProtocolError, match=r"field 'block_ids': \[1, 2\] decodes as \(1, 2\)"):
        REG.encode(make_step_plan(block_ids=[1, 2]))


def test_a_plain_registry_does_not_check_field_types_on_encode():
    plain = Registry("plain")
    plain.register(StepPlan, tag=1)
    assert plain.encode(make_step_plan(step=True))[1].startswith(b'{"step":true,')


# Fuzzing: decode returns the right class or raises ProtocolError, nothing else


def assert_decodes_or_is_a_protocol_error(kind, payload):
    try:
        out = REG.decode(kind, payload)
    except ProtocolError:
        return
    assert REG.tag_of(type(out)) == split_kind(kind)[0]
    assert REG.encode(out)[0] == kind  # anything decode accepts, a verifying encode accepts


@FAST
@given(
    kind=st.sampled_from([STEP_KIND, RICH_KIND, make_kind(1, 2), 0]) | st.integers(-1, 2**33),
    payload=st.binary(max_size=64) | st.sampled_from([b"{}", b"[]", b'{"step":1}']),
)
def test_random_bytes_and_kinds_decode_or_raise_a_protocol_error(kind, payload):
    assert_decodes_or_is_a_protocol_error(kind, payload)


json_scalars = st.none() | st.booleans() | ints | floats | texts
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
rich_keys = st.sampled_from([f.name for f in dataclasses.fields(Rich)]) | texts


@FAST
@given(obj=st.dictionaries(rich_keys, json_values, max_size=16))
def test_random_json_objects_decode_or_raise_a_protocol_error(obj):
    assert_decodes_or_is_a_protocol_error(RICH_KIND, orjson.dumps(obj))


@st.composite
def mutated_rich_objects(draw):
    """A valid Rich JSON object with one member somewhere replaced, deleted or added."""
    root = orjson.loads(REG.encode(draw(rich_messages))[1])
    node: Any = root
    while True:
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = draw(st.sampled_from(keys)) if keys else None
        child = node[key] if keys else None
        if not isinstance(child, (dict, list)) or not draw(st.booleans()):
            break
        node = child
    action = draw(st.sampled_from(["replace", "delete", "add"]))
    if key is not None and action == "replace":
        node[key] = draw(json_values)
    elif key is not None and action == "delete":
        del node[key]
    elif isinstance(node, dict):
        node[draw(texts)] = draw(json_values)
    else:
        node.append(draw(json_values))
    return root


@FAST
@given(obj=mutated_rich_objects())
def test_mutated_valid_objects_decode_or_raise_a_protocol_error(obj):
    assert_decodes_or_is_a_protocol_error(RICH_KIND, orjson.dumps(obj))


# The fast way (msgspec, taken only for a frame this codec writes) against the converters

SLOW = Registry("engine->worker", fast=False)
SLOW.register(StepPlan, tag=1)
SLOW.register(Rich, tag=2, version=3)


def decoded_by(registry, kind, payload):
    """What ``registry`` makes of a frame: the message, or the error's text and field."""
    try:
        return registry.decode(kind, payload)
    except ProtocolError as e:
        return ("error", str(e), e.field)


def test_a_frame_this_codec_wrote_is_built_without_parsing_it_into_python_objects(monkeypatch):
    msg = make_rich()
    kind, payload = REG.encode(msg)
    # The same fields in another order are valid too, but only the converters say so.
    reordered = orjson.dumps(dict(reversed(orjson.loads(payload).items())))

    def parsed(_payload):
        raise AssertionError("the converters' way parsed the frame")

    monkeypatch.setattr(orjson, "loads", parsed)
    assert REG.decode(kind, payload) == msg
    assert REG.decode(kind, memoryview(payload)) == msg
    with pytest.raises(AssertionError, match="converters' way"):
        REG.decode(kind, reordered)


def test_frames_another_writer_wrote_decode_as_the_converters_read_them():
    kind, payload = REG.encode(make_rich())
    fields = orjson.loads(payload)
    spaced = orjson.dumps(fields, option=orjson.OPT_INDENT_2)
    backwards = orjson.dumps(dict(reversed(fields.items())))
    whole = orjson.dumps(fields | {"ratio": 2})  # an int where a float goes
    for frame in (spaced, backwards, whole):
        assert REG.decode(kind, frame) == SLOW.decode(kind, frame)
    decoded = REG.decode(kind, whole)
    assert isinstance(decoded, Rich) and decoded.ratio == 2.0


@FAST
@given(msg=rich_messages)
def test_a_payload_is_byte_for_byte_what_orjson_writes_of_the_dataclass_itself(msg):
    # codec.dumps hands orjson each dataclass as a dict (faster than orjson's own slotted
    # path); the frames must not change by it.
    assert REG.encode(msg)[1] == orjson.dumps(msg, default=hex_default)


@FAST
@given(msg=rich_messages)
def test_the_fast_way_and_the_converters_agree_on_every_valid_message(msg):
    kind, payload = REG.encode(msg)
    assert decoded_by(REG, kind, payload) == decoded_by(SLOW, kind, payload) == msg


@FAST
@given(obj=mutated_rich_objects() | st.dictionaries(rich_keys, json_values, max_size=16))
def test_the_fast_way_and_the_converters_agree_on_every_mutated_frame(obj):
    payload = orjson.dumps(obj)
    assert decoded_by(REG, RICH_KIND, payload) == decoded_by(SLOW, RICH_KIND, payload)


# Registration


def test_a_registry_lists_its_classes_in_registration_order():
    assert list(REG) == [StepPlan, Rich]
    assert len(REG) == 2
    assert [REG.tag_of(cls) for cls in REG] == [1, 2]


def test_a_duplicate_tag_is_a_type_error_at_decoration():
    reg = Registry("r")
    message(reg, tag=1)(StepPlan)
    with pytest.raises(TypeError, match=r"^r: tag 1 is taken by StepPlan$"):

        @message(reg, tag=1)
        @dataclass(frozen=True, slots=True, kw_only=True)
        class Other:
            x: int

    assert list(reg) == [StepPlan]


def test_registering_a_class_twice_is_a_type_error():
    reg = Registry("r")
    reg.register(StepPlan, tag=1)
    with pytest.raises(TypeError, match=r"^r: StepPlan is already registered$"):
        reg.register(StepPlan, tag=2)


@pytest.mark.parametrize(
    "params",
    [
        {"slots": True, "kw_only": True},
        {"frozen": True, "kw_only": True},
        {"frozen": True, "slots": True},
    ],
)
def test_a_class_that_is_not_frozen_slotted_and_kw_only_is_a_type_error(params):
    class Loose:
        x: int

    with pytest.raises(TypeError, match=r"Loose must be @dataclass\(frozen=True, slots=True"):
        message(Registry("r"), tag=1)(dataclass(**params)(Loose))


def test_a_class_that_is_not_a_dataclass_is_a_type_error():
    class Plain:
        x: int

    with pytest.raises(TypeError, match=r"^r: .*Plain is not a dataclass"):
        message(Registry("r"), tag=1)(Plain)


@pytest.mark.parametrize(
    ("annotation", "shown"),
    [
        (list[int], "list[int]"),
        (bytearray, "bytearray"),
        (Any, "typing.Any"),
        (int | str, "int | str"),
        (dict[int, int], "dict[int, int]"),
        (tuple, "tuple"),
        (tuple[int, ...] | list[int], "tuple[int, ...] | list[int]"),
        (Optional[list[int]], "list[int]"),  # noqa: UP045
    ],
)
def test_an_unsupported_annotation_is_a_type_error_naming_the_field(annotation, shown):
    bad = dataclasses.make_dataclass(
        "Bad", [("xs", annotation)], frozen=True, slots=True, kw_only=True
    )
    with pytest.raises(TypeError, match="unsupported annotation") as info:
        message(Registry("r"), tag=1)(bad)
    assert str(info.value).startswith(f"r: Bad.xs: unsupported annotation {shown}")


@pytest.mark.parametrize(
    ("field_type", "reason"),
    [
        ("Literal[True]", "Literal values must be str or int"),
        ("Literal[1.5]", "Literal values must be str or int"),
        ("MutableSpan", "^r: Bad.x: MutableSpan must be a frozen dataclass$"),
        ("Node", "^r: Node.child: Node contains itself"),
        ("NoSuchName", "cannot resolve the annotations of"),
    ],
)
def test_a_bad_nested_or_literal_annotation_is_a_type_error(field_type, reason):
    namespace = {"__annotations__": {"x": field_type}, "__module__": __name__}
    bad: type = dataclass(frozen=True, slots=True, kw_only=True)(type("Bad", (), namespace))
    with pytest.raises(TypeError, match=reason):
        message(Registry("r"), tag=1)(bad)


@pytest.mark.parametrize(
    ("tag", "version", "error", "text"),
    [
        (0, 1, ValueError, "tag must be in 1..65535, got 0"),
        (70000, 1, ValueError, "tag must be in 1..65535, got 70000"),
        (1, 0, ValueError, "version must be in 1..65535, got 0"),
        (1, 65536, ValueError, "version must be in 1..65535, got 65536"),
        ("1", 1, TypeError, "tag must be an int, got '1'"),
        (True, 1, TypeError, "tag must be an int, got True"),
    ],
)
def test_an_out_of_range_tag_or_version_fails_at_decoration(tag, version, error, text):
    reg = Registry("r")
    with pytest.raises(error, match=f"^r: {text}$"):
        message(reg, tag=tag, version=version)(StepPlan)
    assert len(reg) == 0


def test_the_largest_tag_and_version_are_allowed():
    reg = Registry("r")
    reg.register(StepPlan, tag=0xFFFF, version=0xFFFF)
    kind, payload = reg.encode(make_step_plan())
    assert kind == 0xFFFF_FFFF
    assert reg.decode(kind, payload) == make_step_plan()


Key = NewType("Key", bytes)
KEYS = Registry("engine->store", verify=True)


@message(KEYS, tag=1)
@dataclass(frozen=True, slots=True, kw_only=True)
class Keyed:
    keys: tuple[Key, ...]
    raw: bytes = b""


def test_bytes_travel_as_lowercase_hex_and_come_back_as_bytes():
    msg = Keyed(keys=(Key(bytes(range(16))), Key(b"")), raw=b"\xff\x00")
    kind, payload = KEYS.encode(msg)
    assert orjson.loads(payload) == {"keys": [bytes(range(16)).hex(), ""], "raw": "ff00"}
    assert KEYS.decode(kind, payload) == msg


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("AB", "expected lowercase hex of whole bytes, got 'AB'"),
        ("abc", "expected lowercase hex of whole bytes, got 'abc'"),
        ("ab cd", "expected lowercase hex of whole bytes, got 'ab cd'"),
        ("zz", "expected lowercase hex of whole bytes, got 'zz'"),
        (12, "expected str of hex, got int"),
        (None, "expected str of hex, got null"),
    ],
)
def test_a_bytes_field_that_is_not_lowercase_hex_of_whole_bytes_is_refused_naming_it(value, reason):
    kind = make_kind(1, 1)
    with pytest.raises(ProtocolError) as info:
        KEYS.decode(kind, orjson.dumps({"keys": ["00", value]}))
    assert info.value.field == "keys[1]"
    assert reason in str(info.value)

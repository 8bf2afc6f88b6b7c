"""Fuzzing what a user types or writes: ``--set`` overrides, TOML config files, and
workload files (JSON lines).

Whatever the input, loading it gives a config or a workload, or raises the loader's
``ValueError`` (``ConfigError``, ``WorkloadError``) that names where the problem is: the
``--set`` key or the config file (and the dotted key when one is to blame), the
workload file and line (and the key when one is to blame). Never another exception.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from pathlib import Path

import orjson
import pytest
from fuzzing import Form, run_examples
from hypothesis import strategies as st

from ringfence.actors.config import Config
from ringfence.runtime.config import dump_config, load_config
from ringfence.runtime.imports import import_target
from ringfence.sched.workload import KEYS, WorkloadError, parse_workload
from ringfence.shm.errors import ConfigError

# CI: 100 inputs of each kind; the soak: 5,000 (each an example, the frames of fuzzing.Form).
FORMS = [
    pytest.param(Form(examples=100, batches=1, batch=1, frames=100), id="ci"),
    pytest.param(Form(examples=5_000, batches=1, batch=1, frames=5_000), id="soak",
                 marks=pytest.mark.slow),
]  # fmt: skip


def dotted_keys(cls: type = Config, prefix: str = "") -> list[str]:
    """Every dotted key of the config schema, ``actors.<name>`` tables under a few names."""
    keys = []
    hints = typing.get_type_hints(cls)
    for name, path in getattr(cls, "TOOLS", {}).items():  # the tools' sections, by path
        keys += dotted_keys(import_target(path), f"{prefix}{name}.")  # type: ignore[arg-type]
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if f.metadata.get("tools"):
            continue
        if dataclasses.is_dataclass(tp):
            keys += dotted_keys(tp, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        elif typing.get_origin(tp) is typing.get_origin(typing.Mapping[str, int]):
            item = typing.get_args(tp)[1]
            for name in ("engine", "worker", "x"):
                keys += dotted_keys(item, f"{prefix}{f.name}.{name}.")
        else:
            keys.append(prefix + f.name)
    return keys


KEYS_OF_CONFIG = dotted_keys()
words = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.-0123456789 ", max_size=16)
keys = st.one_of(
    st.sampled_from(KEYS_OF_CONFIG),
    st.sampled_from(KEYS_OF_CONFIG).map(lambda k: k.rsplit(".", 1)[0]),  # a table
    words,
    st.text(max_size=12),
)
# TOML value texts: well-formed ones of every type, out-of-range ones, and garbage.
toml_values = st.one_of(
    st.integers().map(str),
    st.sampled_from(("0", "-1", "4096", str(2**63), "1" + "0" * 4400, "0x10", "1_000")),
    st.floats().map(repr),
    st.sampled_from(("inf", "-inf", "nan", "1e999", "true", "false", "''", '""', "[]", "{}")),
    st.sampled_from(("float32", "cuda:7", "ringfence.actors.engine:TOPOLOGY", "s3", "trace")),
    st.text(max_size=20).map(lambda t: orjson.dumps(t).decode()),  # a quoted string
    st.lists(st.integers(-3, 3).map(str), max_size=4).map(lambda xs: f"[{', '.join(xs)}]"),
    st.sampled_from(("[" * 3000 + "]" * 3000, "{a = {b = {c = 1}}}", "[1, 'a']", '"""x"""')),
    st.text(max_size=20),
)


def check_overrides(overrides: list[str]) -> int:
    try:
        config = load_config(None, overrides)
    except ConfigError as e:
        assert str(e).startswith("--set "), e
        assert e.key is None or e.key in str(e) or repr(e.key) in str(e), (e.key, str(e))
    else:
        assert isinstance(config, Config)
    return 1


@pytest.mark.parametrize("form", FORMS)
def test_any_set_overrides_give_a_config_or_a_config_error_naming_the_key(form):
    one = st.tuples(keys, toml_values).map("=".join) | st.text()
    run_examples(form, st.lists(one, max_size=4), check_overrides)


DEFAULT_TOML = dump_config(Config()).splitlines()


@st.composite
def toml_files(draw: st.DrawFn) -> bytes:
    """The default config's TOML with lines replaced, added, dropped or cut, or garbage."""
    lines = list(DEFAULT_TOML)
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(lines)))
        edit = draw(st.sampled_from(("value", "line", "drop", "table", "cut")))
        if edit == "value" and at < len(lines) and " = " in lines[at]:
            lines[at] = f"{lines[at].split(' = ')[0]} = {draw(toml_values)}"
        elif edit == "line":
            lines.insert(at, f"{draw(keys)} = {draw(toml_values)}")
        elif edit == "drop" and at < len(lines):
            del lines[at]
        elif edit == "table":
            lines.insert(at, f"[{draw(keys)}]")
        elif edit == "cut":
            lines = lines[:at]
    data = "\n".join(lines).encode()
    return draw(st.sampled_from((data, data + draw(st.binary(max_size=8)), draw(st.binary()))))


def check_config_file(path: Path, data: bytes) -> int:
    path.write_bytes(data)
    try:
        config = load_config(path)
    except ConfigError as e:
        assert str(e).startswith(f"{path}: "), e
        assert e.key is None or e.key in str(e) or repr(e.key) in str(e), (e.key, str(e))
    else:
        assert isinstance(config, Config)
    return 1


@pytest.mark.parametrize("form", FORMS)
def test_any_config_file_gives_a_config_or_a_config_error_naming_the_file_and_key(tmp_path, form):
    run_examples(form, toml_files(), lambda data: check_config_file(tmp_path / "cfg.toml", data))


# Workload files.

GOOD_LINE = {"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 4, "arrival_s": 0.5}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**30), 10**30) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)


@st.composite
def workload_lines(draw: st.DrawFn) -> str | bytes:
    """One line: a good request with keys dropped, added or given any JSON value, or
    JSON that is not an object, or text that is not JSON (NaN and Infinity included)."""
    line = dict(GOOD_LINE)
    if draw(st.booleans()):
        line = {"id": draw(st.text(max_size=4)), "prompt": draw(st.text(max_size=8))}
    for _ in range(draw(st.integers(0, 3))):
        key = draw(st.sampled_from(KEYS) | st.text(max_size=6))
        if draw(st.booleans()):
            line.pop(key, None)
        else:
            line[key] = draw(json_values)
    text = json.dumps(line)  # any int, and NaN or Infinity as JSON readers of Python take them
    return draw(
        st.sampled_from(
            (
                text,
                text.replace("0.5", "NaN"),
                text.replace("0.5", "-Infinity"),
                text[: len(text) // 2],
                "[" * 200 + "]" * 200,
                "[" * 5000 + "]" * 5000,  # deeper than Python's stack
                text.replace("4", "4" + "0" * 5000),  # longer than Python converts
                '{"id": "a", "id": "b", "prompt": "x"}',
                "",
                "  ",
            )
        )
        | st.text(max_size=24)
        | st.binary(max_size=24)
    )


def check_workload(lines: list[str | bytes]) -> int:
    try:
        requests = parse_workload(lines, source="w.jsonl")
    except WorkloadError as e:
        assert e.line is not None and str(e).startswith(f"w.jsonl:{e.line}: "), e
        assert e.key is None or e.key in str(e), (e.key, str(e))
    else:
        assert len({r.id for r in requests}) == len(requests)
    return 1


@pytest.mark.parametrize("form", FORMS)
def test_any_workload_lines_give_requests_or_a_workload_error_naming_the_line(form):
    run_examples(form, st.lists(workload_lines(), max_size=6), check_workload)


# Found by fuzzing (fixed in sched/workload.py).


def test_an_integer_too_long_to_convert_is_a_workload_error_naming_its_line():
    line = '{"id": "a", "prompt": "x", "max_tokens": 1' + "0" * 5000 + "}"
    with pytest.raises(WorkloadError, match=r"^w\.jsonl:1: "):
        parse_workload([line], source="w.jsonl")


def test_json_nested_too_deeply_is_a_workload_error_naming_its_line():
    with pytest.raises(WorkloadError, match=r"^w\.jsonl:1: "):
        parse_workload(["[" * 100_000 + "]" * 100_000], source="w.jsonl")


def test_an_integer_too_long_to_convert_in_a_set_is_text_the_key_refuses():
    with pytest.raises(ConfigError, match=r"^--set runtime\.spin_us: expected a number, got str"):
        load_config(None, ["runtime.spin_us=1" + "0" * 5000])


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("v = " + "[" * 3000 + "]" * 3000, "nested too deeply"),
        ("[runtime]\nspin_us = 1" + "0" * 5000, "4300 digits"),
    ],
    ids=["nested", "long-int"],
)
def test_toml_that_python_cannot_read_is_a_config_error_naming_the_file(tmp_path, text, reason):
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{path}: invalid TOML: .*{reason}"):
        load_config(path)

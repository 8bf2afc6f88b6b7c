"""The settings that exist to measure or debug are marked as such: in ``--set``'s help and in
the config a run dir holds."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from ringfence.runtime import cli
from ringfence.runtime.config import dump_config, load_config, schema, setting
from ringfence.runtime.config_tables import debug_settings

MARKED = [
    "runtime.wait (poll)",
    "transfer.mode (sync, lock)",
    "transfer.chaos_delay_ms",
    "transfer.skip_fences",
    "transfer.profile",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Inner:
    knob: int = setting(0, "a knob", debug=())


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Outer:
    mode: str = setting("real", "the mode", debug=("fake",))
    plain: int = setting(1, "not marked")
    inner: Inner = dataclasses.field(default_factory=Inner)


def test_the_schema_marks_the_baselines_and_the_debug_aids_and_nothing_else():
    assert debug_settings(schema()) == MARKED


def test_launch_and_serve_help_list_them_under_set():
    parser = cli.build_parser()
    cli.fill_all(parser)
    for command in ("launch", "serve"):
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        (option,) = [a for a in sub.choices[command]._actions if a.dest == "overrides"]
        assert option.help is not None
        assert option.help.endswith(
            "To measure or debug only, never for a production run: runtime.wait (poll), "
            "transfer.mode (sync, lock), transfer.chaos_delay_ms, transfer.skip_fences, "
            "transfer.profile"
        ), option.help


def test_a_written_config_ends_their_doc_with_the_mark():
    lines = dump_config(load_config()).splitlines()
    marked = [
        (lines[i + 1].split(" = ")[0], line) for i, line in enumerate(lines) if "[to " in line
    ]
    assert [(key, line.rpartition(" [")[2]) for key, line in marked] == [
        ("mode", "to measure or debug: sync, lock]"),
        ("chaos_delay_ms", "to measure or debug]"),
        ("skip_fences", "to measure or debug]"),
        ("profile", "to measure or debug]"),
        ("wait", "to measure or debug: poll]"),
    ]
    assert load_config() == load_config().loads(dump_config(load_config()))  # still loads back


def test_a_section_marks_a_setting_by_its_debug_values_in_the_order_of_its_fields():
    assert debug_settings(Outer) == ["mode (fake)", "inner.knob"]


@pytest.mark.parametrize("key", ["runtime.wait=poll", "transfer.mode=lock"])
def test_a_marked_setting_still_loads_as_any_other(key):
    name, _, value = key.partition("=")
    section, field = name.split(".")
    assert getattr(load_config(None, [key]).section(section), field) == value

"""Every ``--help`` of the ``ringfence`` command is plain words: no reST or Markdown markup
from the docstrings (double backquotes, ``:func:``-style roles, single backquotes)."""

from __future__ import annotations

import argparse
import re

import pytest

from ringfence.actors.commands import TABLE
from ringfence.runtime import cli

MARKUP = re.compile(r"``|:[a-z]+:`|`[^`\n]+`|\*\*")


def every_parser(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """``parser`` and every subcommand's parser below it, each with its command words."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += every_parser(sub, (*path, name))
    return found


def filled_parser() -> argparse.ArgumentParser:
    """The ``ringfence`` parser with every command's arguments added (each is added only
    when its command is chosen)."""
    parser = cli.build_parser()
    cli.fill_all(parser)
    return parser


PARSERS = every_parser(filled_parser())


def test_the_walk_reaches_every_command_and_every_benchmark():
    paths = {" ".join(path) for path, _ in PARSERS}
    expected = {"", "launch", "serve", "router", "replay", "clean", "bench"} | {
        f"bench {b}" for b in TABLE.benchmarks
    }
    assert paths == expected


@pytest.mark.parametrize(
    ("path", "parser"), PARSERS, ids=[" ".join(p) or "ringfence" for p, _ in PARSERS]
)
def test_a_commands_help_has_no_markup_and_says_what_it_does(path, parser):
    text = parser.format_help()
    assert not MARKUP.findall(text), f"ringfence {' '.join(path)} --help:\n{text}"
    assert parser.description, f"ringfence {' '.join(path)} --help has no description"


def test_building_the_parser_adds_no_commands_arguments_until_one_is_chosen():
    parser = cli.build_parser()
    bench_e2e = dict(every_parser(parser))[("bench", "e2e")]
    assert [a.dest for a in bench_e2e._actions] == ["help"]
    assert dict(every_parser(filled_parser()))[("bench", "e2e")]._actions[1:]


def test_the_markup_check_catches_backquotes_and_roles():
    assert MARKUP.findall("The ``ringfence`` command, see :func:`main` and `launch`")
    assert not MARKUP.findall("run dir (default: runtime.run_dir/<run id>); exit 1: a violation")

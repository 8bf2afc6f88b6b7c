"""``ringfence bench faults``: its rows, its table, and a row named that does not exist."""

from __future__ import annotations

import argparse

import pytest

from ringfence.actors.tools.bench.faults.cli import _row, add_arguments, main
from ringfence.actors.tools.bench.faults.matrix import matrix
from ringfence.actors.tools.bench.faults.runner import Outcome


def test_the_matrix_names_every_fault_of_the_issue_once():
    names = [s.name for s in matrix(quick=True)]
    assert len(names) == len(set(names))
    for wanted in ("kill swap lane", "kill store lane", "kill worker", "kill engine"):
        assert wanted in names
    for wanted in ("kill supervisor", "client flood", "client killed mid-stream"):
        assert wanted in names
    assert sum(name.startswith(("storage", "redis")) for name in names) == 5
    assert [s.name for s in matrix(quick=False)] == names


def test_a_row_shows_completed_of_given_a_hang_and_a_failed_replay():
    outcome = Outcome("kill worker", injected=2, requests=4, completed=3, replay="FAIL: [I1] x")
    row = _row(outcome)
    assert row.startswith("kill worker") and " 3/4 " in row and " FAIL " in row
    assert row.split()[-2] == "hang" and not outcome.ok


def test_an_unknown_fault_is_an_error_naming_it_and_the_known_ones():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--quick", "--only", "kill everything"])
    args.json = None
    with pytest.raises(ValueError, match=r"unknown fault\(s\) \['kill everything'\].*kill worker"):
        main(args)

"""The suite's scheduling list (tests/suite_order.py's LONGEST_FIRST) names files that exist: a
renamed or removed test file must be renamed or removed there too."""

from __future__ import annotations

from pathlib import Path

from suite_order import LONGEST_FIRST

ROOT = Path(__file__).resolve().parents[2]


def test_every_file_collected_first_exists_and_is_named_once() -> None:
    missing = [path for path in LONGEST_FIRST if not (ROOT / path).is_file()]
    assert missing == [], f"tests/suite_order.py LONGEST_FIRST names missing files: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_every_folder_run_as_one_unit_exists() -> None:
    from suite_order import ONE_UNIT

    assert all(folder.endswith("/") and (ROOT / folder).is_dir() for folder in ONE_UNIT)

"""``ringfence bench hop``: the report has every figure and ratio; the runs leave nothing behind.

No timing thresholds: the figures are noisy on a shared machine; this checks the harness.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from ringfence.actors.tools.testing.shm import leaked_names, shm_names
from ringfence.runtime import cli


def test_a_quick_hop_bench_reports_ring_and_hop_rates_with_their_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report_path = tmp_path / "hop.json"
    before = shm_names()
    status = cli.main(["bench", "hop", "--quick", "--messages", "2000", "--json", str(report_path)])
    assert status == 0
    report = orjson.loads(report_path.read_bytes())
    assert report["messages"] == 2000 and report["rounds"] == 1
    assert set(report["samples"]) == {"ring", "hop_info", "hop_trace"}
    assert all(len(v) == 1 and v[0] > 0 for v in report["samples"].values())
    median = report["median_msgs_per_s"]
    assert report["ratios"]["hop_info_over_ring"] == pytest.approx(
        median["hop_info"] / median["ring"]
    )
    assert report["ratios"]["hop_trace_over_hop_info"] == pytest.approx(
        median["hop_trace"] / median["hop_info"]
    )
    assert set(report["log_ns"]) == {
        f"trace_{how}_{level}_ns" for how in ("guarded", "unguarded") for level in ("info", "trace")
    }
    out = capsys.readouterr().out
    assert "x the bare ring" in out and "x the info rate" in out
    assert leaked_names(before) == []  # the runs it launched (in this process) left no name


def test_bad_hop_bench_options_are_refused_with_a_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "hop", "--messages", "0"]) == 2
    assert "--messages" in capsys.readouterr().err

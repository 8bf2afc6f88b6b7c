"""``ringfence bench worker``: every figure, ratio and the logits check; no timing asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import orjson
import pytest

from ringfence.runtime import cli


def test_a_quick_worker_bench_reports_both_sides_ratios_and_the_logits_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers", reason="the baseline is a transformers forward")
    path = tmp_path / "worker.json"
    assert cli.main(["bench", "worker", "--quick", "--json", str(path)]) == 0
    report = orjson.loads(path.read_bytes())
    assert report["preset"] == "tiny" and report["parameters"] > 0 and report["threads"] >= 1
    check = report["logits_check"]
    assert check["passed"] and check["float32_max_abs_diff"] < check["tolerance"]
    for phase in ("prefill", "decode"):
        assert set(report["tok_s"][phase]) == {"paged", "transformers"}
        assert all(tok_s > 0 for tok_s in report["tok_s"][phase].values())
        assert report["ratios"][phase] > 0
        assert isinstance(report["meets_target"][phase], bool)
        assert all(len(s) == 2 for s in report["seconds"][phase].values())  # quick: 2 rounds
    assert report["target_ratio"] == 0.8
    out = capsys.readouterr().out
    assert "logits check" in out and "x transformers" in out and "parameters" in out


def test_a_nonpositive_worker_bench_count_is_refused_with_a_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "worker", "--quick", "--decode-steps", "0"]) == 2
    assert "--decode-steps 0" in capsys.readouterr().err


def test_an_unsupported_worker_bench_dtype_is_refused_by_the_parser(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["bench", "worker", "--quick", "--dtype", "float16"])
    assert exited.value.code == 2
    assert "--dtype" in capsys.readouterr().err


def test_an_unknown_worker_bench_preset_is_refused_with_a_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "worker", "--preset", "huge"]) == 2
    assert "--preset" in capsys.readouterr().err


def test_without_transformers_the_worker_bench_says_so_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    assert cli.main(["bench", "worker", "--quick"]) == 2
    assert "needs transformers" in capsys.readouterr().err

"""``ringfence bench attention``: the kernel alone, whole and split, on the same keys. On the
CPU it runs in Triton's interpreter: the report's shape and the settings' agreement are
checked, never a timing."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from ringfence.actors.model.kernels import triton_available
from ringfence.actors.tools.bench import attention as bench_attention
from ringfence.runtime import cli

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="Triton is not installed (the test extra installs it)"
)


@needs_triton
def test_a_quick_attention_bench_reports_each_setting_over_the_same_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "attention.json"
    argv = ["bench", "attention", "--quick", "--device", "cpu", "--json", str(path)]
    assert cli.main([*argv, "--seqs", "1,2", "--max-kv-gib", "0.00003"]) == 0
    report = orjson.loads(path.read_bytes())
    assert report["device"] == "cpu" and report["shape"] == bench_attention.QUICK_SHAPE
    one, two = report["points"]
    assert (one["seqs"], one["context"]) == (1, 40)
    # 40 keys of 2 layers, 2 KV heads x 16 dims in float32: 20 KiB a sequence; the cap 30 KiB.
    assert two == {"seqs": 2, "context": 40, "skipped": "KV over 3e-05 GiB"}
    assert one["kv_bytes"] == 40 * 2 * 2 * 2 * 16 * 4
    whole, split = one["settings"]
    assert (whole["setting"], whole["splits"], split["setting"], split["splits"]) == (1, 1, 3, 3)
    assert whole["tile"] == split["tile"] == 16, "the interpreter's tile"
    assert whole["speedup"] == 1.0 and whole["max_diff"] == 0.0
    assert split["max_diff"] < 1e-5, "three shares merged attend as one program does"
    for r in (whole, split):
        assert r["us"] > 0
        assert r["gbps"] == pytest.approx(one["kv_bytes"] / 2 / (r["us"] * 1e-6) / 1e9)
        assert r["roofline"] == pytest.approx(r["gbps"] / report["copy_gbps"])
    assert split["speedup"] == pytest.approx(whole["us"] / split["us"])
    out = capsys.readouterr().out
    assert "paged attention alone on cpu (interpreted)" in out and "skipped" in out


def test_split_settings_are_checked_naming_the_bad_one() -> None:
    assert bench_attention.parse_splits("1, auto,graph,4") == [1, "auto", "graph", 4]
    with pytest.raises(ValueError, match=r"--splits: '0' is not auto, graph or a count"):
        bench_attention.parse_splits("1,0")
    with pytest.raises(ValueError, match="names no setting"):
        bench_attention.parse_splits(" , ")


@needs_triton
def test_each_tile_is_timed_and_attends_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "attention.json"
    argv = ["bench", "attention", "--quick", "--device", "cpu", "--seqs", "1", "--json", str(path)]
    assert cli.main([*argv, "--splits", "1", "--tiles", "16,32"]) == 0
    (point,) = orjson.loads(path.read_bytes())["points"]
    assert [r["tile"] for r in point["settings"]] == [16, 32]
    assert point["settings"][1]["max_diff"] < 1e-5
    capsys.readouterr()
    assert cli.main([*argv, "--tiles", "24"]) == 2
    err = capsys.readouterr().err
    assert "--tiles: each must be a power of two of at least 16, got [24]" in err


@needs_triton
def test_a_prefill_chunk_is_read_whole_and_counted_in_products(tmp_path: Path) -> None:
    path = tmp_path / "attention.json"
    argv = ["bench", "attention", "--quick", "--device", "cpu", "--seqs", "2", "--json", str(path)]
    assert cli.main([*argv, "--chunk", "8"]) == 0
    report = orjson.loads(path.read_bytes())
    assert report["chunk"] == 8
    (point,) = report["points"]
    assert [r["splits"] for r in point["settings"]] == [1, 1], "a chunk is never split"
    # 2 sequences x 8 queries at positions 32..39, each seeing every key up to its own.
    products = 4 * 4 * 16 * 2 * sum(33 + t for t in range(8))
    for r in point["settings"]:
        assert r["tflops"] == pytest.approx(products / (r["us"] * 1e-6) / 1e12)
        assert r["max_diff"] == 0.0
    assert cli.main([*argv, "--chunk", "41"]) == 2, "a chunk longer than its context"

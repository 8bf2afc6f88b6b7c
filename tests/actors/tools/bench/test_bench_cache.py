"""``ringfence bench cache``: every figure and ratio is reported; nothing is asserted on timings."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from ringfence.runtime import cli

INDEX_OPS = {"key", "match", "acquire", "free_acquired", "allocate_evicting", "free", "fence"}


def test_a_quick_cache_bench_reports_each_index_op_memory_and_storage_ratios(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cache.json"
    argv = ["bench", "cache", "--quick", "--backends", "local,memory", "--json", str(path)]
    assert cli.main(argv) == 0
    report = orjson.loads(path.read_bytes())
    index = report["index"]
    assert set(index["us_per_block"]) == INDEX_OPS
    assert all(us > 0 for us in index["us_per_block"].values())
    assert index["cached_blocks"] > 19_000
    assert index["bytes_per_cached_block"] > index["bytes_per_cached_block_without_keys"] > 0
    storage = report["storage"]
    assert set(storage["median"]) == {"plain", "plain_fsync", "local", "memory"}
    assert set(storage["ratios"]) == {"local", "memory"}
    for ratio in storage["ratios"].values():
        assert set(ratio) == {"put_vs_plain_write", "put_vs_plain_write_fsync", "get_vs_plain_read"}
    assert set(storage["presence"]) == {"local", "memory"}
    for asked in storage["presence"].values():
        assert asked["caller_us"] > 0 and asked["asker_us"] > 0 and asked["asker_vs_caller"] > 0
    out = capsys.readouterr().out
    assert "bytes per cached block" in out and "x plain write" in out


def test_unknown_cache_bench_backends_are_refused_with_a_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "cache", "--quick", "--backends", "local,tape"]) == 2
    assert "--backends" in capsys.readouterr().err


def test_the_secret_runs_each_backend_also_with_keyed_blobs_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cache.json"
    argv = ["bench", "cache", "--quick", "--backends", "memory", "--secret", "--json", str(path)]
    assert cli.main(argv) == 0
    storage = orjson.loads(path.read_bytes())["storage"]
    assert set(storage["median"]) == {"plain", "plain_fsync", "memory", "memory+secret"}
    assert storage["median"]["memory+secret"]["get_mb_s"] > 0
    assert "memory+secret" in capsys.readouterr().out

"""``ringfence bench transfer``: every bandwidth figure and the fence/sync throughput; no timing
asserted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import torch

from ringfence.actors.model.kernels import triton_available
from ringfence.actors.tools.bench import launcher, transfer_bandwidth
from ringfence.runtime import cli


def check_bandwidth(report: dict[str, Any], methods: tuple[str, ...] = transfer_bandwidth.METHODS):
    bandwidth = report["bandwidth"]
    assert bandwidth["preset"] == "tiny" and bandwidth["block_bytes"] > 0
    assert bandwidth["methods"] == list(methods)
    rows = bandwidth["rows"]
    expected = {(d, n) for d in ("h2d", "d2h") for n in transfer_bandwidth.QUICK_BATCHES}
    assert {(r["direction"], r["blocks"]) for r in rows} == expected
    for row in rows:
        assert set(row["gb_s"]) == set(methods)
        assert all(gb_s > 0 for gb_s in row["gb_s"].values())
        assert row["ratio"] > 0 and row["ratio_consecutive"] > 0
        judged = row["blocks"] >= transfer_bandwidth.TARGET_MIN_BLOCKS
        assert isinstance(row["meets_target"], bool) if judged else row["meets_target"] is None
        kernel = transfer_bandwidth.KERNEL in methods
        assert ("ratio_kernel" in row) == kernel and ("kernel_meets_target" in row) == kernel
    assert bandwidth["target_ratio"] == 0.7


def test_a_quick_bandwidth_only_transfer_bench_reports_every_method(tmp_path: Path) -> None:
    path = tmp_path / "transfer.json"
    assert cli.main(["bench", "transfer", "--quick", "--skip-harness", "--json", str(path)]) == 0
    report = orjson.loads(path.read_bytes())
    check_bandwidth(report)
    assert report["bandwidth"]["device"] == "cpu"


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the device tier on cuda"
)


@needs_cuda
def test_on_cuda_a_quick_transfer_bench_copies_to_and_from_the_device(tmp_path: Path) -> None:
    # The harness on the device runs in scripts/device-check's bench step.
    path = tmp_path / "transfer.json"
    argv = ["bench", "transfer", "--quick", "--skip-harness", "--device", "cuda"]
    assert cli.main([*argv, "--json", str(path)]) == 0
    report = orjson.loads(path.read_bytes())
    kernel = (transfer_bandwidth.KERNEL,) if triton_available() else ()
    check_bandwidth(report, (*transfer_bandwidth.CUDA_METHODS, *kernel))
    assert report["bandwidth"]["device"] == torch.cuda.get_device_name()


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed (the test extra)")
@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton is compiled here, not interpreted")
def test_on_the_cpu_the_transfer_bench_times_the_block_kernel_only_when_asked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "transfer.json"
    argv = ["bench", "transfer", "--quick", "--skip-harness", "--rounds", "1", "--kernel"]
    assert cli.main([*argv, "--json", str(path)]) == 0
    report = orjson.loads(path.read_bytes())
    check_bandwidth(report, (*transfer_bandwidth.METHODS, transfer_bandwidth.KERNEL))
    bandwidth = report["bandwidth"]
    assert bandwidth["kernel_target_ratio"] == 0.8
    for row in bandwidth["rows"]:
        assert row["ratio_kernel"] > 0
        judged = row["blocks"] >= transfer_bandwidth.TARGET_MIN_BLOCKS
        assert isinstance(row["kernel_meets_target"], bool) == judged
    assert "copy_kernel >= 0.8x plain" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_transfer_bench_on_a_device_torch_cannot_see_is_refused_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "transfer", "--quick", "--device", "cuda"]) == 2
    assert "--device cuda: torch sees no CUDA device" in capsys.readouterr().err
    assert cli.main(["bench", "transfer", "--quick", "--device", "tpu"]) == 2
    assert "--device: 'tpu' is neither cpu nor cuda" in capsys.readouterr().err


@pytest.mark.slow  # two launched harness runs: ~30 s; the harness itself is tested in CI
def test_a_quick_transfer_bench_reports_every_method_and_both_harness_modes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "transfer.json"
    assert cli.main(["bench", "transfer", "--quick", "--json", str(path)]) == 0
    report = orjson.loads(path.read_bytes())
    check_bandwidth(report)
    harness = report["harness"]
    assert set(harness["ops_per_s"]) == {"fence", "sync"}
    assert all(ops_per_s > 0 for ops_per_s in harness["ops_per_s"].values())
    assert harness["ratio"] > 0
    for mode in ("fence", "sync"):
        assert harness["reports"][mode]["ops"] > 0
    out = capsys.readouterr().out
    assert "GB/s" in out and "fence / sync" in out


@pytest.mark.parametrize(
    "option", [["--rounds", "0"], ["--programs", "0"], ["--threads", "0"], ["--preset", "huge"]]
)
def test_a_bad_transfer_bench_option_is_refused_with_exit_status_2(
    option: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "transfer", "--quick", *option]) == 2
    assert option[0] in capsys.readouterr().err


def test_a_failed_harness_run_is_an_error_with_exit_status_1_and_the_bandwidth_is_kept(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(launcher, "ringfence_command", lambda: ["false"])
    path = tmp_path / "transfer.json"
    assert cli.main(["bench", "transfer", "--quick", "--rounds", "1", "--json", str(path)]) == 1
    assert "exited with status 1" in capsys.readouterr().err
    report = orjson.loads(path.read_bytes())
    assert "exited with status 1" in report["harness_error"] and "harness" not in report
    assert report["bandwidth"]["rows"], "what was measured is written"

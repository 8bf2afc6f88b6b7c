"""``ringfence bench worker``: every figure, ratio and the logits check; no timing asserted."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from hf_checkpoints import FAMILIES, save_family

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
    sampling = report["sampling"]["ms_per_step"]  # masked (grammar) and unmasked steps
    assert set(sampling) == {"plain", "logprobs", "penalties", "all", "hot", "every", "grammar"}
    assert all(ms > 0 for ms in sampling.values())
    out = capsys.readouterr().out
    assert "logits check" in out and "x transformers" in out and "parameters" in out
    assert "grammar " in out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_quick_worker_bench_of_a_checkpoint_runs_each_side_from_its_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], family: str
) -> None:
    pytest.importorskip("transformers", reason="the baseline is transformers")
    # Mistral's window (16) is shorter than the check's 40 tokens and the quick lengths.
    window: dict[str, Any] = {"sliding_window": 16} if family == "MistralForCausalLM" else {}
    save_family(tmp_path / "checkpoint", family, seed=2, **window)
    path = tmp_path / "worker.json"
    argv = ["bench", "worker", "--quick", "--model", str(tmp_path / "checkpoint")]
    assert cli.main([*argv, "--json", str(path)]) == 0
    report = orjson.loads(path.read_bytes())
    assert report["family"] == family and report["checkpoint"] == str(tmp_path / "checkpoint")
    assert report["preset"] is None
    check = report["logits_check"]
    assert check["passed"] and check["float32_argmax_equal"], check
    assert report["decode_greedy_tokens_equal"] == 1.0
    for phase in ("prefill", "decode"):
        assert all(tok_s > 0 for tok_s in report["tok_s"][phase].values())
        assert report["ratios"][phase] > 0
    assert f"{family} checkpoint" in capsys.readouterr().out


def test_a_quick_worker_bench_of_a_gguf_file_runs_transformers_from_the_same_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers", reason="the baseline is transformers")
    pytest.importorskip("accelerate", reason="transformers loads GGUF files with accelerate")
    pytest.importorskip("gguf", reason="writes a GGUF file")
    from gguf_files import tiny_weights, write_tiny

    file = write_tiny(tmp_path / "tiny.gguf", tiny_weights(3))
    path = tmp_path / "worker.json"
    assert cli.main(["bench", "worker", "--quick", "--model", str(file), "--json", str(path)]) == 0
    report = orjson.loads(path.read_bytes())
    assert report["checkpoint"] == str(file) and report["family"] == "LlamaForCausalLM"
    check = report["logits_check"]
    assert check["passed"] and check["float32_argmax_equal"], check
    assert report["decode_greedy_tokens_equal"] == 1.0
    assert all(report["ratios"][phase] > 0 for phase in ("prefill", "decode"))
    assert "checkpoint" in capsys.readouterr().out


def test_a_quick_worker_bench_times_the_named_backends_against_the_roofline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("transformers", reason="the baseline is a transformers forward")
    path = tmp_path / "worker.json"
    argv = ["bench", "worker", "--quick", "--backends", "torch", "--json", str(path)]
    assert cli.main(argv) == 0
    report = orjson.loads(path.read_bytes())
    if not torch.cuda.is_available():  # the Worker's path on a CPU
        assert report["paged_path"] == {"attention": "torch", "cuda_graphs": False}
    assert set(report["backends"]) == {"torch"}
    torch_side = report["backends"]["torch"]
    assert torch_side["prefill_ms"] > 0 and torch_side["decode_step_ms"] > 0
    assert torch_side["greedy_tokens_equal_to_first"] == 1.0
    roof = report["roofline"]
    assert roof["copy_bandwidth_gb_s"] > 0 and roof["decode_step_bytes"] > 0
    assert roof["decode_floor_ms"] == pytest.approx(
        roof["decode_step_bytes"] / (roof["copy_bandwidth_gb_s"] * 1e9) * 1e3
    )
    assert set(roof["ratio_to_floor"]) == {"paged", "torch"}
    assert roof["ratio_to_floor"]["torch"] == pytest.approx(
        torch_side["decode_step_ms"] / roof["decode_floor_ms"]
    )
    out = capsys.readouterr().out
    assert "roofline: a decode step reads" in out and "x the floor" in out


def test_an_unknown_worker_bench_backend_is_refused_naming_the_known_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "worker", "--quick", "--backends", "torch,flash"]) == 2
    assert "--backends: unknown ['flash']; known: torch, triton, triton+graphs" in (
        capsys.readouterr().err
    )


def test_a_worker_bench_of_both_a_checkpoint_and_a_preset_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "worker", "--model", str(tmp_path), "--preset", "tiny"]) == 2
    assert "--model and --preset" in capsys.readouterr().err


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_worker_bench_on_a_device_torch_cannot_see_is_refused_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("transformers", reason="the baseline is transformers")
    assert cli.main(["bench", "worker", "--quick", "--device", "cuda"]) == 2
    assert "--device cuda: torch sees no CUDA device" in capsys.readouterr().err
    assert cli.main(["bench", "worker", "--quick", "--device", "tpu"]) == 2
    assert "--device: 'tpu' is neither cpu nor cuda" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: both sides on cuda")
def test_on_cuda_a_quick_worker_bench_runs_both_sides_there_with_equal_greedy_tokens(
    tmp_path: Path,
) -> None:
    pytest.importorskip("transformers", reason="the baseline is a transformers forward")
    path = tmp_path / "worker.json"
    assert cli.main(["bench", "worker", "--quick", "--device", "cuda", "--json", str(path)]) == 0
    report = orjson.loads(path.read_bytes())
    assert report["device"] == torch.cuda.get_device_name()
    assert report["logits_check"]["passed"] and report["decode_greedy_tokens_equal"] == 1.0
    assert all(report["tok_s"][phase]["paged"] > 0 for phase in ("prefill", "decode"))
    assert report["paged_path"] == {"attention": "triton", "cuda_graphs": True}
    assert set(report["backends"]) == {"torch", "triton", "triton+graphs"}
    assert all(v["greedy_tokens_equal_to_first"] == 1.0 for v in report["backends"].values())


def test_without_transformers_the_worker_bench_says_so_and_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import raises ImportError
    assert cli.main(["bench", "worker", "--quick"]) == 2
    assert "needs transformers" in capsys.readouterr().err

"""``ringfence bench decode``: the report's structure and its figures' consistency (the parts of
a step add up to it, the roofline ratios are floor over step); never a wall-clock limit."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

import orjson
import pytest

from ringfence.actors.tools.bench import decode as decode_bench
from ringfence.actors.tools.bench import decode_report
from ringfence.actors.tools.bench.decode import seqs_of
from ringfence.actors.tools.bench.decode_launch import Shape, settings, step_split, write_workload
from ringfence.actors.tools.bench.launcher import RunError
from ringfence.runtime import cli
from ringfence.sched.workload import parse_workload

MS = 1_000_000  # nanoseconds


def worker_line(
    step: int, end_ms: float, *, seqs: int, exec_ms: float, **timed: float
) -> dict[str, Any]:
    line = {"event": "step.done", "step": step, "status": "ok", "mono_ns": int(end_ms * MS)}
    line |= {"pieces": seqs, "tokens": seqs, "exec_ns": int(exec_ms * MS), "wait_ns": 0}
    return line | {f"{key}_ns": int(ms * MS) for key, ms in timed.items()}


def engine_lines(step: int, issued_ms: float, received_ms: float) -> list[dict[str, Any]]:
    return [
        {"event": "op.issue", "lane": "step", "op": step, "mono_ns": int(issued_ms * MS)},
        {"event": "sched.step", "step": step, "mono_ns": int(received_ms * MS)},
    ]


def test_a_steady_step_splits_into_forward_sampling_engine_and_idle_that_add_up_to_it():
    # Steps 2, 3 and 4 decode both sequences; step 1 is the prefill (4 tokens).
    worker = [
        {**worker_line(1, 9.0, seqs=2, exec_ms=8.0), "tokens": 4},
        worker_line(2, 19.0, seqs=2, exec_ms=7.0, forward=5.0, sample=1.0),
        worker_line(3, 29.0, seqs=2, exec_ms=8.0, forward=6.0, sample=2.0),
        worker_line(4, 39.0, seqs=2, exec_ms=8.5, forward=6.0, sample=1.5),
    ]
    engine = [
        *engine_lines(1, 0.0, 9.5),
        *engine_lines(2, 10.0, 19.5),
        *engine_lines(3, 21.0, 29.5),
        *engine_lines(4, 30.0, 39.5),
    ]
    worker[0] |= {"forward_ns": 7 * MS, "sample_ns": MS}
    worker[3]["checked_ahead"] = True  # step 4's plan was checked while step 3 ran
    worker[3]["launched_ahead"] = True  # and its kernels queued before step 3 was reported
    split = step_split(worker, engine, seqs=2)
    assert split["checked_ahead"] == pytest.approx(0.5)
    assert split["launched_ahead"] == pytest.approx(0.5)
    # Steps 3 and 4 (step 2 follows the prefill): cycles 29 - 19 and 39 - 29 ms; the plans
    # came 21 - 19 = 2 and 30 - 29 = 1 ms after the step before ended.
    assert split["steady_steps"] == 2 and split["forward_source"] == "forward_ns"
    assert split["step_ms"] == pytest.approx(10.0)
    parts = split["parts_ms"]
    assert parts == pytest.approx({"forward": 6.0, "sampling": 1.75, "engine": 1.5, "idle": 0.75})
    assert sum(parts.values()) == pytest.approx(split["step_ms"])
    assert split["between_ms"] == pytest.approx(2.25)
    assert split["device_busy"] == pytest.approx(12.0 / 20.0)
    # The Worker's cycle: the same steps over their execution.
    cycle = split["worker_cycle"]
    assert cycle["steps"] == 2
    assert (cycle["cycle_ms"], cycle["exec_ms"]) == (pytest.approx(10.0), pytest.approx(8.25))
    assert cycle["over_exec"] == pytest.approx(10.0 / 8.25)
    # The engine's turn: results of 2 and 3 at 19.5 and 29.5, steps 3 and 4 issued at 21, 30.
    turn = split["engine_turn"]
    assert turn["steps"] == 2 and turn["turn_ms"] == pytest.approx(1.0)


def test_without_the_engines_lines_engine_and_idle_are_one_figure_and_exec_counts_as_forward():
    worker = [worker_line(s, 10.0 * s, seqs=3, exec_ms=4.0) for s in (1, 2, 3)]
    split = step_split(worker, None, seqs=3)
    assert split["steady_steps"] == 2 and split["forward_source"] == "exec_ns"
    assert split["parts_ms"] == {"forward": pytest.approx(4.0), "sampling": None} | {
        "engine": None,
        "idle": None,
    }
    assert split["between_ms"] == pytest.approx(6.0)


def test_a_step_issued_before_the_last_ones_result_puts_no_engine_time_on_its_path():
    # Two steps in flight: step 3 is issued (12 ms) before step 2 ends (20 ms).
    worker = [
        worker_line(s, 10.0 * s, seqs=1, exec_ms=6.0, forward=5.0, sample=1.0) for s in (2, 3)
    ]
    engine = [*engine_lines(2, 2.0, 19.5), *engine_lines(3, 12.0, 29.5)]
    split = step_split(worker, engine, seqs=1)
    assert split["steady_steps"] == 1 and split["step_ms"] == pytest.approx(10.0)
    assert split["parts_ms"]["engine"] == pytest.approx(0.0)
    assert split["parts_ms"]["idle"] == pytest.approx(4.0)


def test_with_two_in_flight_the_prefill_is_not_counted_in_the_first_decode_step():
    # Step 2 is issued at 0.1 ms, beside the prefill (step 1, 100 ms); its issue-to-issue span
    # (0.1 -> 101 ms) holds the prefill, but the decode runs a step every 5 ms.
    worker = [{**worker_line(1, 100.0, seqs=2, exec_ms=99.0), "tokens": 64}]
    worker += [worker_line(s, 100.0 + 5 * (s - 1), seqs=2, exec_ms=4.0) for s in (2, 3, 4, 5)]
    engine = [*engine_lines(1, 0.0, 100.2), *engine_lines(2, 0.1, 105.2)]
    for s in (3, 4, 5):  # issued 2 ms before the step ahead of it ends
        engine += engine_lines(s, 88.0 + 5 * s, 95.2 + 5 * s)
    split = step_split(worker, engine, seqs=2)
    assert split["steady_steps"] == 3 and split["step_ms"] == pytest.approx(5.0)
    assert split["checked_ahead"] == 0.0
    assert split["parts_ms"]["engine"] == pytest.approx(0.0)
    assert split["device_busy"] == pytest.approx(0.8)
    assert split["worker_cycle"]["over_exec"] == pytest.approx(1.25)
    # At the info level, the same steps.
    assert step_split(worker, None, seqs=2)["step_ms"] == pytest.approx(5.0)


def test_with_two_in_flight_the_engines_turn_runs_from_a_result_to_the_step_after_next():
    # Step 4 is issued (22 ms) 2.5 ms after step 2's result; step 5 (31 ms) 1.5 ms after 3's.
    worker = [worker_line(s, 10.0 * s, seqs=1, exec_ms=5.0) for s in (2, 3, 4, 5)]
    engine = [*engine_lines(2, 2.0, 19.5), *engine_lines(3, 12.0, 29.5)]
    engine += [*engine_lines(4, 22.0, 39.5), *engine_lines(5, 31.0, 49.5)]
    turn = step_split(worker, engine, seqs=1)["engine_turn"]
    assert turn["steps"] == 2
    assert (turn["turn_ms"], turn["over_exec"]) == (pytest.approx(2.0), pytest.approx(0.4))
    # A turn that ends in a step no steady one (the run's tail) is not counted.
    assert step_split(worker[:3], engine, seqs=1)["engine_turn"]["steps"] == 1


def test_a_run_with_no_step_where_every_sequence_decodes_is_refused():
    worker = [{**worker_line(1, 5.0, seqs=2, exec_ms=4.0), "tokens": 16}]
    with pytest.raises(RunError, match="no steady decode step of 2 sequences"):
        step_split(worker, [], seqs=2)


def test_the_workload_is_the_engines_format_all_arriving_at_once(tmp_path: Path):
    path = tmp_path / "w.jsonl"
    write_workload(path, Shape(seqs=3, prompt_tokens=5, output_tokens=7, vocab_size=11))
    requests = parse_workload(path.read_bytes())
    assert [r.id for r in requests] == ["r0", "r1", "r2"]
    for r in requests:
        assert r.arrival_s == 0.0 and r.params.max_tokens == 7 and r.params.ignore_eos
        assert r.prompt_token_ids is not None and len(r.prompt_token_ids) == 5
        assert all(0 <= t < 11 for t in r.prompt_token_ids)
    shape = Shape(seqs=3, prompt_tokens=5, output_tokens=27, vocab_size=11)
    sets = settings(shape, ["model.preset=small", "cache.device_blocks=64"], trace=True)
    assert sets.index("sched.max_num_seqs=3") < sets.index("model.preset=small")
    assert "runtime.log_level=trace" in sets
    # 2 blocks of 16 a request and one spare each; then the one given, which wins.
    assert [s for s in sets if s.startswith("cache.device_blocks")] == [
        "cache.device_blocks=9",
        "cache.device_blocks=64",
    ]


def test_batch_sizes_are_the_devices_unless_given_and_a_bad_list_is_named():
    args = argparse.Namespace(seqs=None, quick=False)
    assert seqs_of(args, cuda=True) == (1, 8, 64, 256) and seqs_of(args, cuda=False) == (1, 8, 64)
    assert seqs_of(argparse.Namespace(seqs="2,16", quick=False), cuda=True) == (2, 16)
    with pytest.raises(ValueError, match=r"^--seqs: '2,x' is not"):
        seqs_of(argparse.Namespace(seqs="2,x", quick=False), cuda=False)
    with pytest.raises(ValueError, match=r"^--seqs: '0': every batch size"):
        seqs_of(argparse.Namespace(seqs="0", quick=False), cuda=False)


def check_point(point: dict[str, Any], counts: dict[str, int]) -> None:
    n, launch, step = point["seqs"], point["launch"], point["launch"]["step"]
    assert launch["output_tokens"] == n * counts["output_tokens"]
    assert launch["output_tokens_per_s"] > 0 and launch["ttft_p50_ms"] > 0
    assert 0 < launch["tpot_p50_ms"] <= launch["tpot_p90_ms"]
    assert step["steady_steps"] >= 1 and step["step_ms"] > 0
    parts = step["parts_ms"]
    assert set(parts) == {"forward", "sampling", "engine", "idle"}
    assert parts["forward"] > 0 and parts["engine"] >= 0  # trace level: the engine is timed
    known = [value for value in parts.values() if value is not None]
    assert math.isclose(sum(known), step["step_ms"], rel_tol=1e-9) or parts["sampling"] is None
    assert 0 < step["device_busy"] <= 1
    roof = point["roofline"]
    assert 0 < roof["floor_ms"]["forward"] <= roof["floor_ms"]["launch"]  # a longer context
    assert roof["launch"] == pytest.approx(roof["floor_ms"]["launch"] / step["step_ms"])
    assert roof["forward"] == pytest.approx(
        roof["floor_ms"]["forward"] / point["forward"]["step_ms"]
    )
    if point["transformers"] is None:  # an N not among --transformers-seqs
        assert roof["transformers"] is None
    else:
        assert roof["transformers"] == pytest.approx(
            roof["floor_ms"]["forward"] / point["transformers"]["step_ms"]
        )
        assert point["transformers"]["how"] == "eager"  # the CPU: no compile
    kernels = point["kernels"]  # the forward's CPU ops, grouped (decode_kernels.py)
    assert kernels["device"] == "cpu" and kernels["steps"] >= 1 and kernels["weights_floor_ms"] > 0
    classes = kernels["classes"]
    assert {"gemm", "attention", "kv store"} <= set(classes)  # every layer's matmuls and KV
    assert classes["gemm"]["count"] > 0 and classes["attention"]["count"] > 0
    assert kernels["kernel_ms"] == pytest.approx(sum(c["ms"] for c in classes.values()))
    assert list(classes) == sorted(classes, key=lambda name: -classes[name]["ms"])


# Each batch size is a launch of its own, then the forward alone and transformers' at that
# size. CI runs the quick form at N = 4 alone (every side, every figure and the plot); the
# quick form's own sizes (1 and 4: two launches, the table's two lines) run with -m slow,
# transformers timed at N = 4 alone.
@pytest.mark.parametrize(
    ("seqs", "sizes"),
    [pytest.param(None, [1, 4], marks=pytest.mark.slow, id="quick-1-4"), ("4", [4])],
)  # and at N = 4 a --vs launch beside the first
def test_the_quick_decode_bench_reports_every_side_at_each_batch_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], seqs: str | None, sizes: list[int]
) -> None:
    pytest.importorskip("transformers", reason="the baseline is transformers")
    pytest.importorskip("matplotlib", reason="--plot draws with matplotlib")
    path, png = tmp_path / "decode.json", tmp_path / "decode.png"
    argv = ["bench", "decode", "--quick", "--threads", "1", "--folder", str(tmp_path / "runs")]
    argv += ["--seqs", seqs] if seqs else []
    vs = "sched.steps_in_flight=2"
    argv += ["--vs", vs, "--vs-seqs", "4", "--transformers-seqs", "4"]
    assert cli.main([*argv, "--json", str(path), "--plot", str(png)]) == 0
    report = orjson.loads(path.read_bytes())
    assert report["model"]["preset"] == "tiny" and report["model"]["dtype"] == "float32"
    assert report["counts"] == {"prompt_tokens": 8, "output_tokens": 4, "forward_steps": 2}
    assert [p["seqs"] for p in report["points"]] == sizes
    assert [p["transformers"] is not None for p in report["points"]] == [n == 4 for n in sizes]
    assert report["copy_bandwidth_gb_s"] > 0 and report["log_level"] == "trace"
    for point in report["points"]:
        check_point(point, report["counts"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "copy bandwidth" in out and "roofline" in out and "where the forward's time goes" in out
    rows = [line for line in out.splitlines() if line.lstrip().startswith(("1 ", "4 "))]
    assert [int(line.split()[0]) for line in rows if " with " not in line] == sizes
    # The --vs launch: at N = 4 alone, its own run with the override as well, named beside.
    assert [list(p.get("vs", {})) for p in report["points"]] == [
        [vs] if p == 4 else [] for p in sizes
    ]
    beside = report["points"][-1]["vs"][vs]
    assert beside["output_tokens"] == 4 * report["counts"]["output_tokens"]
    assert "steps_in_flight = 2" in (Path(beside["run_dir"]) / "config.toml").read_text()
    assert (
        "steps_in_flight = 2"
        not in (Path(report["points"][-1]["launch"]["run_dir"]) / "config.toml").read_text()
    )
    assert f"   4 with {vs}: " in out


def test_a_gpus_kernels_are_grouped_by_class_per_step_and_the_costliest_named():
    from ringfence.actors.tools.bench.decode_kernels import group_kernels, kernel_class

    rows = [  # (name, count, microseconds) over two steps, as a GPU's profile names them
        ("nvjet_tst_64x8_64x16_4x1_v_bz_coopB_TNT", 128, 1800.0),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", 2, 120.0),
        ("_paged_attention", 32, 600.0),
        ("_store_kv", 32, 40.0),
        ("_add_rms_norm_rows", 32, 60.0),
        ("_rms_norm_rows", 34, 70.0),
        ("_rotate_rows", 32, 50.0),
        ("_silu_mul_rows", 32, 64.0),
        ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", 34, 80.0),
        ("Memcpy HtoD (Pageable -> Device)", 2, 10.0),
        ("void at::native::(anonymous namespace)::indexSelectLargeIndex<float>", 2, 6.0),
    ]
    assert kernel_class("cutlass_80_tensorop_bf16_s16816gemm") == "gemm"
    assert kernel_class("some_new_kernel") == "other"
    grouped = group_kernels(rows, steps=2)
    classes = grouped["classes"]
    assert list(classes)[:2] == ["gemm", "attention"]  # largest first
    assert classes["gemm"] == pytest.approx({"count": 65.0, "ms": 0.96})
    assert classes["norm"] == pytest.approx({"count": 33.0, "ms": 0.065})
    assert (classes["rotary"]["count"], classes["activation"]["count"]) == (16.0, 16.0)
    assert (classes["elementwise"]["count"], classes["copy"]["count"]) == (17.0, 1.0)
    assert classes["index"]["count"] == 1.0 and classes["kv store"]["count"] == 16.0
    assert grouped["kernels"] == pytest.approx(sum(count for _, count, _ in rows) / 2)
    assert grouped["kernel_ms"] == pytest.approx(sum(us for _, _, us in rows) / 2e3)
    costliest = [kernel["name"] for kernel in grouped["costliest"]]
    assert costliest == [rows[0][0], "_paged_attention", rows[1][0], rows[8][0], "_rms_norm_rows"]
    assert grouped["costliest"][0] == pytest.approx({"name": rows[0][0], "count": 64, "ms": 0.9})


def test_a_batch_size_transformers_skipped_is_reported_and_drawn_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--transformers-seqs`` picks sizes of ``--seqs`` (a bad list is named); a point
    without transformers prints n/a and plots without its bar."""
    seqs = (1, 8, 64)
    assert decode_bench._some_seqs(None, "--transformers-seqs", seqs) == seqs
    assert decode_bench._some_seqs("64,4", "--transformers-seqs", seqs) == (64,)
    with pytest.raises(ValueError, match=r"^--transformers-seqs: '4,x' is not a comma"):
        decode_bench._some_seqs("4,x", "--transformers-seqs", seqs)
    pytest.importorskip("matplotlib", reason="--plot draws with matplotlib")
    step: dict[str, Any] = {
        "step_ms": 2.0, "device_busy": 0.5, "between_ms": 1.0,
        "parts_ms": {"forward": 1.0, "sampling": 0.2, "engine": 0.3, "idle": 0.5},
        "worker_cycle": {"over_exec": 1.1}, "engine_turn": {"turn_ms": 0.4},
    }  # fmt: skip
    launch: dict[str, Any] = {"output_tokens_per_s": 100.0, "ttft_p50_ms": 5.0}
    launch |= {"tpot_p50_ms": 2.0, "tpot_p90_ms": 2.5, "step": step}
    roof: dict[str, Any] = {
        "floor_ms": {"forward": 0.1, "launch": 0.1},
        "launch": 0.05,
        "forward": 0.1,
    }
    point: dict[str, Any] = {
        "seqs": 1,
        "launch": launch,
        "forward": {"step_ms": 1.0},
        "transformers": None,
    }
    point["roofline"] = roof | {"transformers": None}
    report = {
        "torch": "t", "transformers": "h", "device": "cpu", "threads": 1, "log_level": "trace",
        "model": {"checkpoint": None, "preset": "tiny", "parameters": 1, "dtype": "float32"},
        "counts": {"prompt_tokens": 8, "output_tokens": 4}, "copy_bandwidth_gb_s": 1.0,
        "points": [point],
    }  # fmt: skip
    decode_report.print_report(report)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("   1 "))
    assert row.split()[-1] == "n/a" and row.split()[-6] == "n/a", "hf's step and its roofline"
    assert "transformers on a static cache, not timed" in out
    decode_report.write_plot(tmp_path / "plot.png", report)
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"

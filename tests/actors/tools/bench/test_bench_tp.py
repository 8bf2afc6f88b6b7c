"""``ringfence bench tp``: the all-reduce figures from Worker logs, the rows over rounds, the
options and errors; one real run of both sizes on the tiny preset (slow). No timing asserted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from ringfence.actors.tools.bench import e2e_runs, launcher
from ringfence.actors.tools.bench import tp as bench_tp
from ringfence.actors.tools.bench.launcher import RunError
from ringfence.runtime import cli

MS = 1_000_000


def step(n: int, *, exec_ms: int, reduce_ms: int | None, **fields: Any) -> dict[str, Any]:
    """A Worker's step.done line (reduce_ns and reduces are None under tp 1, as logged)."""
    line = {
        "event": "step.done",
        "step": n,
        "status": "ok",
        "pieces": 1,
        "tokens": 1,
        "wait_ns": 0,
        "exec_ns": exec_ms * MS,
        "reduce_ns": None if reduce_ms is None else reduce_ms * MS,
        "reduces": None if reduce_ms is None else 4,
    }
    return {**line, **fields}


def write_log(run_dir: Path, rank: int, lines: list[dict[str, Any]]) -> None:
    ready = {"event": "worker.ready", "step_done": 0}
    data = b"".join(orjson.dumps(line) + b"\n" for line in [ready, *lines])
    (run_dir / f"worker-{rank}.jsonl").write_bytes(data)


def test_the_step_figures_count_every_ranks_steps_that_ran_and_skip_the_rest(
    tmp_path: Path,
) -> None:
    write_log(
        tmp_path,
        0,
        [
            step(1, exec_ms=10, reduce_ms=2),
            step(2, exec_ms=10, reduce_ms=4),
            step(3, exec_ms=50, reduce_ms=40, status="cancelled"),  # did not run
            step(4, exec_ms=50, reduce_ms=None, pieces=0),  # an empty step: nothing to run
        ],
    )
    write_log(tmp_path, 1, [step(1, exec_ms=20, reduce_ms=6), step(2, exec_ms=20, reduce_ms=8)])
    ranks = [bench_tp.read_worker_log(tmp_path, rank) for rank in (0, 1)]
    stats = bench_tp.step_stats(line for log in ranks for line in log)
    assert stats.steps == 4
    assert stats.reduce_ms_mean == pytest.approx((2 + 4 + 6 + 8) / 4)
    assert stats.reduce_ms_p50 == pytest.approx(5.0)
    assert stats.reduce_share == pytest.approx(20 / 60)
    assert stats.reduces_per_step == 4
    assert stats.exec_ms_mean == pytest.approx(15.0)
    rank_0 = bench_tp.step_stats(ranks[0])
    assert rank_0.steps == 2 and rank_0.reduce_ms_mean == pytest.approx(3.0)


def test_a_single_rank_spends_nothing_in_all_reduces(tmp_path: Path) -> None:
    write_log(tmp_path, 0, [step(1, exec_ms=10, reduce_ms=None)])
    stats = bench_tp.step_stats(bench_tp.read_worker_log(tmp_path, 0))
    assert (stats.reduce_ms_mean, stats.reduce_share, stats.reduces_per_step) == (0, 0, 0)


def test_a_run_dir_without_a_ranks_log_or_with_a_broken_line_is_a_run_error(
    tmp_path: Path,
) -> None:
    with pytest.raises(RunError, match=r"worker-1\.jsonl"):
        bench_tp.read_worker_log(tmp_path, 1)
    (tmp_path / "worker-0.jsonl").write_bytes(b'{"event": "worker.ready"}\n{"event": \n')
    with pytest.raises(RunError, match=r"worker-0\.jsonl line 2: not JSON"):
        bench_tp.read_worker_log(tmp_path, 0)


def side(tp: int, tokens_per_s: float, tokens: dict[str, list[int]], reduce_ms: int) -> Any:
    steps = bench_tp.step_stats(
        [step(1, exec_ms=10, reduce_ms=reduce_ms or None), step(2, exec_ms=10, reduce_ms=0)]
    )
    return bench_tp.TpSide(
        tp=tp,
        side=e2e_runs.Side(
            output_tokens_per_s=tokens_per_s,
            ttft_p50_s=0.5,
            ttft_p99_s=0.9,
            duration_s=10.0,
            tokens=tokens,
            engine={},
            wall_s=20.0,
        ),
        tpot_p50_s=0.1,
        steps=steps,
        ranks=(steps,) * tp,
    )


def test_the_rows_take_medians_over_rounds_and_compare_with_the_first_size() -> None:
    same, flipped = {"a": [1, 2], "b": [3, 4]}, {"a": [1, 2], "b": [3, 5]}
    rows = bench_tp.rows(
        {
            1: [side(1, 100.0, same, 0), side(1, 120.0, same, 0)],
            2: [side(2, 50.0, flipped, 2), side(2, 60.0, same, 6)],
        }
    )
    one, two = rows
    assert (one["tp"], one["output_tokens_per_s"], one["ratio"]) == (1, 110.0, 1.0)
    assert one["reduce_ms_mean"] == 0 and one["tokens_match"] == 1.0
    assert two["output_tokens_per_s"] == 55.0
    assert two["ratio"] == pytest.approx(0.5)
    assert two["reduce_ms_mean"] == pytest.approx((1.0 + 3.0) / 2)  # per round: 2/2, 6/2
    assert two["reduce_share"] == pytest.approx((0.1 + 0.3) / 2)
    assert two["tokens_match"] == 0.5  # round 1: request b flipped a token
    assert (two["ttft_p50_ms"], two["tpot_p50_ms"]) == (500.0, 100.0)
    assert len(two["rounds"]) == 2 and len(two["rounds"][0]["ranks"]) == 2


@pytest.mark.parametrize("bad", ["1,x", "0,2", "2,2", ""])
def test_bad_sizes_are_a_command_line_error_naming_the_option(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "tp", "--quick", "--tp", bad]) == 2
    assert "--tp" in capsys.readouterr().err


def test_the_help_names_the_sizes_and_the_workload(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["bench", "tp", "--help"])
    text = capsys.readouterr().out
    assert "--tp N,..." in text and "--workload" in text and "--rounds" in text


def test_a_failed_launch_is_an_error_with_exit_status_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "ringfence_command", lambda: ["false"])
    assert cli.main(["bench", "tp", "--quick", "--requests", "1"]) == 1
    assert "exited with status 1" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(900)  # two real launches, seven processes for tp 2
def test_a_real_tiny_run_reports_all_reduces_only_for_two_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tp.json"
    args = ["bench", "tp", "--preset", "tiny", "--requests", "2", "--rounds", "1"]
    assert cli.main([*args, "--json", str(path)]) == 0
    report = orjson.loads(path.read_bytes())
    one, two = report["rows"]
    assert (one["tp"], two["tp"]) == (1, 2)
    assert one["output_tokens_per_s"] > 0 and two["output_tokens_per_s"] > 0
    assert one["reduce_ms_mean"] == 0 and one["reduces_per_step"] == 0
    assert two["reduces_per_step"] == 4  # tiny: 2 layers, after attention and after the MLP
    assert 0 < two["reduce_share"] < 1
    assert 0 <= two["tokens_match"] <= 1
    assert "AR share" in capsys.readouterr().out

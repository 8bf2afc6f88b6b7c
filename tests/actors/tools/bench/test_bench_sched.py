"""``ringfence bench sched``: the scheduler's host work per decode step is reported for every
batch size, from steady decode turns only; nothing is asserted on timings."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from ringfence.actors.tools.bench import sched as bench_sched
from ringfence.runtime import cli


def test_a_quick_sched_bench_reports_both_halves_of_a_step_per_batch_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sched.json"
    argv = ["bench", "sched", "--quick", "--device-step-ms", "2", "--json", str(path)]
    assert cli.main(argv) == 0
    report = orjson.loads(path.read_bytes())
    assert (report["context"], report["in_flight"], report["device_step_ms"]) == (64, 2, 2.0)
    assert [p["seqs"] for p in report["points"]] == [4, 16]
    for p in report["points"]:
        assert p["steps"] == 10 and p["schedule_ms"] > 0 and p["apply_ms"] > 0
        both = p["schedule_ms"] + p["apply_ms"]
        assert p["per_seq_us"] == pytest.approx(both * 1e3 / p["seqs"])
        assert p["over_device_step"] == pytest.approx(both / 2.0)
    assert "/ device step" in capsys.readouterr().out


@pytest.mark.parametrize("in_flight", [1, 2])
def test_only_turns_in_which_every_sequence_decodes_are_timed(
    monkeypatch: pytest.MonkeyPatch, in_flight: int
) -> None:
    timed: list[tuple[int, ...]] = []
    steady = bench_sched._steady

    def watched(step, seqs):  # every step the benchmark asks about, and what it answered
        answer = steady(step, seqs)
        timed.append((step.step, answer))
        return answer

    monkeypatch.setattr(bench_sched, "_steady", watched)
    point = bench_sched.measure(seqs=3, context=40, steps=5, in_flight=in_flight)
    assert point["steps"] == 5
    # The first steps prefill the 40-token prompts: never steady, never timed.
    assert timed[0] == (1, False)
    assert sum(answer for _, answer in timed) >= 5


def test_a_batch_size_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "sched", "--seqs", "0"]) != 0
    assert "--seqs" in capsys.readouterr().err

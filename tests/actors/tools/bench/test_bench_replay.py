"""``ringfence bench replay``: options, the summary of canned launches, replay timing on a
hand-written run dir; no timing asserted.

A real bench launches ``2 x --rounds`` runs (about 25 s each on a 2-CPU machine), so the
one end-to-end test is marked slow; everything else here runs in well under a second.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson
import pytest

from ringfence.actors.commands import TABLE
from ringfence.actors.tools.bench import launcher
from ringfence.actors.tools.bench import replay as bench_replay
from ringfence.actors.tools.bench.options import resolve_counts
from ringfence.actors.tools.bench.replay import Launch
from ringfence.runtime import cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    bench_replay.add_arguments(parser)
    return parser.parse_args(argv)


def side(level: str, tokens_per_s: float, *, outputs: dict[str, list[int]] | None = None,
         log_bytes: int = 1000, log_lines: int = 10) -> Launch:  # fmt: skip
    return Launch(
        level=level,
        output_tokens=int(tokens_per_s * 2),
        duration_s=2.0,
        tokens=outputs if outputs is not None else {"a": [1, 2], "b": [3]},
        log_bytes=log_bytes,
        log_lines=log_lines,
        wall_s=20.0,
    )


def write_log(path: Path, entries: list[dict[str, Any]], *, actor: str) -> None:
    lines = [
        orjson.dumps({"ts": 100.0 + i, "level": "trace", "actor": actor, "rank": 0, **e})
        for i, e in enumerate(entries)
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")


def tiny_run(run_dir: Path, steps: int = 3) -> int:
    """A traced run dir by hand: an engine issuing and applying steps a worker did."""
    run_dir.mkdir()
    engine: list[dict[str, Any]] = [{"event": "actor.start"}]
    worker: list[dict[str, Any]] = [{"event": "actor.start"}]
    for n in range(1, steps + 1):
        fence = {"step": n - 1, "swap": 0, "store": 0}
        engine.append({"event": "op.issue", "lane": "step", "op": n, "fence": fence})
        engine.append({"event": "msg.send", "peer": "worker-0", "seq": n})
        worker.append({"event": "msg.recv", "peer": "engine-0", "seq": n})
        worker.append({"event": "step.done", "step": n, "status": "ok", "seen_swap": 0})
        engine.append({"event": "sched.step", "step": n, "status": "ok"})
    write_log(run_dir / "engine-0.jsonl", engine, actor="engine")
    write_log(run_dir / "worker-0.jsonl", worker, actor="worker")
    (run_dir / "outputs.jsonl").write_bytes(b'{"id": "a", "token_ids": [1]}\n')  # not a log
    return len(engine) + len(worker)


def test_the_defaults_and_the_quick_counts() -> None:
    args = parse()
    counts = resolve_counts(args, bench_replay.COUNTS)
    assert counts == {"rounds": 3, "requests": 16, "replays": 3, "timeout": 300}
    assert args.large is None and args.keep is None and args.threads is None
    quick = resolve_counts(parse("--quick"), bench_replay.COUNTS)
    assert quick["rounds"] == 1 and quick["requests"] == 2
    args = parse("--rounds", "5", "--large", "64", "--keep", "/tmp/x", "--replays", "2")
    assert (args.rounds, args.large, args.keep, args.replays) == (5, 64, Path("/tmp/x"), 2)
    with pytest.raises(ValueError, match="--rounds 0"):
        resolve_counts(parse("--rounds", "0"), bench_replay.COUNTS)
    assert TABLE.benchmarks["replay"].module == "ringfence.actors.tools.bench.replay"


def test_the_two_sides_differ_only_in_the_log_level() -> None:
    info = bench_replay.workload("tiny", 16, "info").settings
    trace = bench_replay.workload("tiny", 16, "trace").settings
    assert [s for s in info if s not in trace] == ["runtime.log_level=info"]
    assert [s for s in trace if s not in info] == ["runtime.log_level=trace"]
    for setting in ("sched.preemption=swap", "cache.storage.backend=local", "engine.requests=16"):
        assert setting in trace
    assert "engine.arrivals=false" in trace and "cache.host_blocks=0" not in trace
    blocks = [s for s in trace if s.startswith("cache.device_blocks=")]
    assert blocks == ["cache.device_blocks=176"]  # about half of what 16 requests need


def test_the_summary_is_medians_and_trace_over_info_ratios() -> None:
    info = [side("info", 100.0), side("info", 120.0), side("info", 110.0)]
    trace = [
        side("trace", 90.0, log_bytes=5000, log_lines=40),
        side("trace", 80.0, log_bytes=7000, log_lines=60),
        side("trace", 99.0, log_bytes=6000, log_lines=50, outputs={"a": [1, 2], "b": [4]}),
    ]
    report = bench_replay.summarize(info, trace)
    rows = {row["name"]: row for row in report["rows"]}
    assert rows["throughput"]["info"] == pytest.approx(110.0)
    assert rows["throughput"]["trace"] == pytest.approx(90.0)
    assert report["trace_over_info"] == rows["throughput"]["ratio"] == pytest.approx(90 / 110)
    assert rows["log bytes"]["ratio"] == pytest.approx(6.0)
    assert rows["log lines"]["trace"] == 50 and rows["log lines"]["ratio"] == pytest.approx(5.0)
    assert report["tokens_match"] == pytest.approx(5 / 6)  # one request of six differs
    assert [len(report["sides"][level]) for level in ("info", "trace")] == [3, 3]
    assert report["sides"]["trace"][0]["output_tokens_per_s"] == pytest.approx(90.0)


def test_read_run_is_timed_on_a_tiny_run_dir(tmp_path: Path) -> None:
    events = tiny_run(tmp_path / "run")
    assert bench_replay.log_size(tmp_path / "run")[1] == events  # outputs.jsonl left out
    replay = bench_replay.time_replay(tmp_path / "run", 2, None)
    assert replay["events"] == events and replay["traced"] and not replay["checked"]
    assert len(replay["samples"]["read_s"]) == 2 and replay["read_s"] > 0
    assert replay["total_s"] == replay["read_s"] and replay["check_s"] is None
    assert replay["read_events_per_s"] == pytest.approx(events / replay["read_s"])
    calls: list[int] = []

    def check(log: Any) -> list[str]:
        calls.append(len(log.history))
        return ["one violation"]

    replay = bench_replay.time_replay(tmp_path / "run", 3, check)
    assert calls == [events] * 3 and replay["checked"] and replay["violations"] == 1
    assert replay["total_s"] >= replay["read_s"] and replay["check_events_per_s"] > 0


def test_the_table_prints_both_figures(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    tiny_run(tmp_path / "run")
    figures = bench_replay.summarize([side("info", 100.0)], [side("trace", 95.0)])
    replay = bench_replay.time_replay(tmp_path / "run", 1, lambda log: [])
    report = {
        "torch": "x", "cpus": 2, "threads": 1, "preset": "tiny", "wall_s": 1.0,
        "counts": {"rounds": 1, "requests": 2, "replays": 1, "timeout": 9},
        **figures, "replay": {**replay, "requests": 2},
    }  # fmt: skip
    bench_replay._print(report)
    out = capsys.readouterr().out
    assert "0.950x" in out and "events/s" in out and "check" in out


def test_a_failed_launch_is_an_error_with_exit_status_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(launcher, "ringfence_command", lambda: ["false"])
    monkeypatch.setattr(bench_replay, "resolve_preset", lambda args: "tiny")  # no torch import
    args = parse("--quick", "--keep", str(tmp_path))
    assert bench_replay.main(args) == 1
    assert "exited with status 1" in capsys.readouterr().err


@pytest.mark.slow  # two real launches and a replay: about a minute on 2 CPUs
@pytest.mark.timeout(600)
def test_a_tiny_replay_bench_reports_the_ratio_and_the_replay_speed(tmp_path: Path) -> None:
    path = tmp_path / "replay.json"
    argv = ["bench", "replay", "--quick", "--requests", "2", "--rounds", "1", "--json", str(path)]
    assert cli.main(argv) == 0
    report = orjson.loads(path.read_bytes())
    assert report["counts"]["rounds"] == 1 and report["counts"]["requests"] == 2
    assert report["trace_over_info"] > 0 and report["tokens_match"] == 1.0
    rows = {row["name"]: row for row in report["rows"]}
    assert rows["log lines"]["trace"] > rows["log lines"]["info"] > 0
    replay = report["replay"]
    assert replay["traced"] and replay["events"] == rows["log lines"]["trace"]
    assert replay["read_events_per_s"] > 0 and replay["run_dir"] is None
    assert replay["checked"] and replay["total_events_per_s"] > 0
    assert isinstance(replay["violations"], int)

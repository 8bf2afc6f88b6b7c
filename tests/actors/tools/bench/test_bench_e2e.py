"""``ringfence bench e2e``: the ratios, the JSON and the PNG; no timing asserted.

Twenty-four real launches take minutes on a 2-CPU machine (each one's start-up, four
processes importing torch, is most of it), so here each launch is replaced by the
same run in process (:func:`e2e_runs.run_local`): everything but the subprocess runs.
``ringfence launch`` itself is covered by the launch tests.
"""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from ringfence.actors.tools.bench import e2e as bench_e2e
from ringfence.actors.tools.bench import e2e_runs, launcher
from ringfence.actors.tools.bench.e2e_pairs import Run
from ringfence.actors.tools.testing.redis_server import REDIS_SERVER
from ringfence.runtime import cli


def test_a_quick_e2e_bench_reports_every_pairs_positive_ratio_and_writes_a_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    launched: list[Run] = []

    def in_process(run: Run, *, threads: int, timeout: float, folder: Path):
        launched.append(run)
        return e2e_runs.run_local(run, threads=threads)

    monkeypatch.setattr(bench_e2e, "run_launch", in_process)
    path = tmp_path / "e2e.json"
    assert cli.main(["bench", "e2e", "--quick", "--requests", "3", "--json", str(path)]) == 0
    assert len(launched) == (24 if REDIS_SERVER else 20)
    report = orjson.loads(path.read_bytes())
    ratios = {row["name"]: row["ratio"] for row in report["rows"]}
    pairs = ["fence/sync", "fence/lock", "storage fence/sync", "storage fence/lock"]
    pairs += ["block/poll", "tiers multiturn", "tiers unique", "tiers chat", "actor/local"]
    pairs += ["chat fence/sync", "chat fence/lock"]
    if REDIS_SERVER:
        pairs += ["redis fence/sync", "redis fence/lock"]
    else:
        assert report["skipped"]
    for q in ("p50", "p99"):  # the chat's returning turns
        for name in ("tiers chat", "chat fence/sync", "chat fence/lock"):
            assert isinstance(ratios[f"{name} returning ttft {q}"], float)
    for name in pairs:
        assert isinstance(ratios[name], float) and ratios[name] > 0
    assert ratios["block/poll cpu per token"] is None  # in process: no actor logs
    sides = {r.settings[-1] for r in launched if r.workload == "pressure"}
    assert {"transfer.mode=lock", "runtime.wait=poll", "runtime.wait=block"} <= sides
    chats = {r.settings[-1] for r in launched if r.workload == "chat"}
    assert {"transfer.mode=fence", "transfer.mode=sync", "transfer.mode=lock"} <= chats
    assert report["preset"] == "tiny" and report["counts"]["requests"] == 3
    assert all(0 <= row["tokens_match"] <= 1 for row in report["rows"] if "tokens_match" in row)
    assert (tmp_path / "e2e.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "actor/local" in out and "latency of the ordering pairs" in out
    latency = {row["name"]: row["latency"] for row in report["rows"] if "latency" in row}
    assert {"fence/sync", "fence/lock", "chat fence/lock"} <= set(latency)
    for name, figures in latency.items():  # TTFT p50, p99 and TPOT p99 of each side
        assert all(v is not None and v > 0 for pair in figures.values() for v in pair), name


def test_a_failed_launch_is_an_error_with_exit_status_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "ringfence_command", lambda: ["false"])
    assert cli.main(["bench", "e2e", "--quick", "--requests", "1"]) == 1
    assert "exited with status 1" in capsys.readouterr().err


def test_the_instances_cpu_is_every_actors_cpu_from_its_stop_lines(tmp_path: Path) -> None:
    def log(name: str, *lines: dict[str, object]) -> None:
        (tmp_path / f"{name}.jsonl").write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))

    log("engine-0", {"event": "actor.start"}, {"event": "actor.stop", "cpu_s": 1.5})
    # a restarted Worker: each incarnation's stop counts
    log("worker-0", {"event": "actor.stop", "cpu_s": 2.0}, {"event": "actor.stop", "cpu_s": 0.25})
    log("supervisor-0", {"event": "supervisor.stop"})  # not an actor instance
    assert e2e_runs.instance_cpu_s(tmp_path) == 3.75
    log("swap-0", {"event": "actor.start"})
    with pytest.raises(launcher.RunError, match=r"swap-0\.jsonl: no actor.stop line"):
        e2e_runs.instance_cpu_s(tmp_path)


@pytest.mark.skipif(REDIS_SERVER is None, reason="redis-server is not on PATH (scripts/test)")
def test_the_remote_family_runs_each_mode_on_each_delay_with_storage_through_the_proxy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from ringfence.actors.tools.bench import e2e_remote

    urls: list[str] = []

    def in_process(run: Run, *, threads: int, timeout: float, folder: Path):
        urls.append(next(s for s in run.settings if s.startswith("cache.storage.url=")))
        return e2e_runs.run_local(run, threads=threads)  # it reads and writes redis there

    monkeypatch.setattr(e2e_remote, "run_launch", in_process)
    path = tmp_path / "e2e.json"
    argv = ["bench", "e2e", "--quick", "--requests", "1", "--remote", "0,1", "--remote-only"]
    assert cli.main([*argv, "--json", str(path)]) == 0
    report = orjson.loads(path.read_bytes())
    assert report["rows"] == [] and not (tmp_path / "e2e.png").exists()
    rows = report["remote"]["rows"]
    assert [(r["delay_ms"], r["workload"]) for r in rows] == [
        (0, "storage"), (0, "chat"), (1, "storage"), (1, "chat"),
    ]  # fmt: skip
    for row in rows:
        assert all(t > 0 for t in row["output_tokens_per_s"].values()), row
        assert row["fence_over_lock"] > 0 and row["fence_over_sync"] > 0
    assert set(rows[1]["returning_ttft_p50_s"]) == {"fence", "lock", "sync"}
    assert len(urls) == 12 and len(set(urls[:6])) == 1 and len(set(urls[6:])) == 1
    assert urls[0] != urls[6], "the 1 ms runs reach redis through the proxy's port"
    assert "fence/lock" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--remote", "2,x"], "--remote: '2,x' is not a list of milliseconds"),
        (["--remote", "-1"], "each delay must be >= 0 ms"),
        (["--remote-only"], "--remote-only: give the delays with --remote"),
        (["--remote", "1", "--remote-mbps", "0"], "--remote-mbps: 0.0 must be > 0"),
    ],
)
def test_a_bad_remote_option_is_refused_naming_it(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["bench", "e2e", "--quick", *argv]) == 2
    assert message in capsys.readouterr().err

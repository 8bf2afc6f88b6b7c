"""``ringfence bench serve`` as a command: against tests/fake_serve.py run as the server
(its launches replaced by the fake's own answers), and once end to end against the real
``ringfence serve`` and ``ringfence launch`` at tiny sizes."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import fake_serve
import orjson
import pytest
from certificates import make_certificates
from launching import QUICK

from ringfence.actors.tools.bench import launcher
from ringfence.actors.tools.bench.serving import cli as bench_serve
from ringfence.actors.tools.bench.serving import report
from ringfence.actors.tools.bench.serving.client import LoadRequest
from ringfence.actors.tools.bench.serving.server import Served, cpu_seconds
from ringfence.runtime import cli
from ringfence.sched.workload import parse_workload

FAKE = [sys.executable, fake_serve.__file__]


def fake_launch(
    requests: Sequence[LoadRequest], settings: Sequence[str], folder: Path, timeout: float
) -> dict[str, Any]:
    """What a launch of ``requests`` would report if it answered as the fake does, 1 s each."""
    outputs: list[dict[str, Any]] = [
        {
            "id": r.id,
            "token_ids": fake_serve.expected_tokens(list(r.prompt_token_ids), r.max_tokens),
            "tpot_s": 0.01,
        }
        for r in requests
    ]
    tokens = sum(r.max_tokens for r in requests)
    summary: Mapping[str, Any] = {
        "requests": {"total": len(requests), "finished": len(requests)},
        "tokens": {"output": tokens},
        "duration_s": 1.0,
        "throughput": {"requests_per_s": len(requests), "output_tokens_per_s": tokens},
        "ttft_s": {"p50": 0.05, "p99": 0.09, "mean": 0.06},
    }
    return report.launched(summary, outputs)


def test_a_bench_against_the_fake_server_reports_each_pair_and_the_burst(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "ringfence_command", lambda: FAKE)
    monkeypatch.setattr(bench_serve, "launch_side", fake_launch)
    path = tmp_path / "serve.json"
    argv = ["bench", "serve", "--workloads", "unique,chat", "--rates", "inf,20", "--requests", "3"]
    argv += ["--burst", "8", "--burst-tokens", "3", "--json", str(path)]
    assert cli.main(argv) == 0
    result = orjson.loads(path.read_bytes())
    assert [(r["workload"], r["rate"]) for r in result["rows"]] == [
        ("unique", "inf"),
        ("unique", "20"),
        ("chat", "inf"),
        ("chat", "20"),
    ]
    for row in result["rows"]:
        assert row["serve"]["requests"] == {"total": 3, "finished": 3, "failed": 0}
        assert row["serve"]["model"] == fake_serve.MODEL and row["serve"]["leaked_names"] == []
        assert row["tokens_match"] == 1.0
        assert row["ratios"]["ttft_p50"] > 0 and row["ratios"]["output_tokens_per_s"] > 0
        assert row["serve"]["itl_s"]["p50"] is not None and row["launch"]["itl_s"]["p50"] is None
    burst = result["burst"]
    assert burst["requests"]["finished"] == 8 and burst["output_tokens"] == 24
    assert burst["frontend_cpu_s_per_s"] >= 0 and burst["frontend_cpu_s_per_token"] >= 0
    assert burst["streams"] == 8 and burst["max_tokens"] == 3 and "tokens" not in burst
    assert result["settings"] == ["model.preset=small"]
    assert (tmp_path / "serve.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "TTFT p50 serve/launch" in out and "front end at 8 concurrent streams" in out


def test_security_sides_run_with_a_key_and_over_verified_https_beside_the_plain_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "ringfence_command", lambda: FAKE)
    monkeypatch.setattr(bench_serve, "launch_side", fake_launch)
    certs = make_certificates(tmp_path / "certs")
    path = tmp_path / "serve.json"
    argv = ["bench", "serve", "--workloads", "unique", "--rates", "inf", "--requests", "3"]
    argv += ["--burst", "0", "--json", str(path), "--security", "keys,keys+tls"]
    argv += ["--ssl-certfile", certs.server.certfile, "--ssl-keyfile", certs.server.keyfile]
    assert cli.main([*argv, "--ssl-ca-certs", certs.ca]) == 0, capsys.readouterr().err
    result = orjson.loads(path.read_bytes())
    assert result["security"] == ["keys", "keys+tls"]
    (row,) = result["rows"]
    assert list(row["security"]) == ["keys", "keys+tls"]
    for side in row["security"].values():  # the fake asks for the key, and only speaks TLS
        assert side["figures"]["requests"] == {"total": 3, "finished": 3, "failed": 0}
        assert side["figures"]["ttft_p90_s"] > 0 and "tokens" not in side["figures"]
        assert side["ratios"]["ttft_p50"] > 0 and side["ratios"]["ttft_p90"] > 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines if line.startswith("unique    inf  ")][-3:] == [
        "plain", "keys", "keys+tls",
    ]  # fmt: skip


def test_keys_and_tls_sides_are_refused_without_what_they_need(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["bench", "serve", "--security", "keys,tls"]) == 2
    assert "--security: unknown ['tls']; known: keys, keys+tls" in capsys.readouterr().err
    assert cli.main(["bench", "serve", "--security", "keys+tls"]) == 2
    assert "--security keys+tls needs --ssl-certfile" in capsys.readouterr().err


def test_the_launch_gets_the_same_requests_as_the_server(tmp_path: Path) -> None:
    requests = bench_serve.load_requests("chat", 8, 2.0, seed=0)
    lines = parse_workload(bench_serve.workload_file(requests))
    assert [line.id for line in lines] == [r.id for r in requests]
    for line, r in zip(lines, requests, strict=True):
        assert line.prompt_token_ids == r.prompt_token_ids
        assert line.params.max_tokens == r.max_tokens and line.params.seed == r.seed
        assert line.arrival_s == r.arrival_s and line.session == r.session
    assert lines[1].arrival_s > 0  # the Poisson times, not the workload's own


def test_a_server_that_exits_before_listening_is_a_run_error_with_its_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    command = [sys.executable, "-c", "print('no model here'); raise SystemExit(2)"]
    monkeypatch.setattr(launcher, "ringfence_command", lambda: command)
    with pytest.raises(launcher.RunError, match=r"(?s)exited \(status 2\) within 30 s:.*no model"):
        Served(tmp_path / "run", [], start_timeout=30.0)


def test_a_server_that_listens_but_is_never_ready_is_stopped_at_the_deadline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    line = "ringfence serve: listening on http://h:1 (front end pid {os.getpid()})"
    script = f"import os, time; print(f'{line}', flush=True); time.sleep(60)"
    monkeypatch.setattr(launcher, "ringfence_command", lambda: [sys.executable, "-c", script])
    with pytest.raises(launcher.RunError, match="was not ready within 2 s"):
        Served(tmp_path / "run", [], start_timeout=2.0)


def test_a_stopped_fake_server_exits_and_its_front_end_cpu_was_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(launcher, "ringfence_command", lambda: FAKE)
    with Served(tmp_path / "run", [], start_timeout=30.0) as server:
        assert server.url.startswith("http://127.0.0.1:")
        assert server.frontend_pid == server.proc.pid
        assert server.frontend_cpu_s() > 0  # it imported uvicorn
        assert server.stop(deadline_s=30.0) == []
    assert server.proc.returncode == 0
    with pytest.raises(FileNotFoundError):
        cpu_seconds(server.frontend_pid)


def test_cpu_seconds_reads_utime_and_stime_of_a_process() -> None:
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert cpu_seconds(os.getpid()) > before


def test_failed_requests_and_leaked_names_are_failures_of_the_run() -> None:
    ok = {"requests": {"failed": 0}, "errors": [], "leaked_names": []}
    bad = {"requests": {"failed": 2}, "errors": ["HTTP 503: starting"], "leaked_names": []}
    leaky = {**ok, "leaked_names": ["/rf_ab12_engine"]}
    rows = [{"workload": "chat", "rate": "inf", "serve": bad, "launch": ok}]
    assert report.failures({"rows": rows, "burst": leaky}) == [
        "chat @ inf/s serve: 2 request(s) failed: ['HTTP 503: starting']",
        "burst: the server left ['/rf_ab12_engine'] in /dev/shm",
    ]
    assert report.failures({"rows": [{**rows[0], "serve": ok}], "burst": None}) == []


def test_bad_options_are_refused_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, name in (
        (["--rates", "0"], "--rates"),
        (["--workloads", "nope"], "--workloads"),
        (["--requests", "0"], "--requests"),
        (["--rates", "1,inf,1.0"], "--rates: 1 given twice"),
        (["--workloads", "chat,chat"], "--workloads: chat given twice"),
    ):
        assert cli.main(["bench", "serve", *argv]) == 2
        assert name in capsys.readouterr().err


# Slow (two real instances): CI runs the fake-server tests above, and
# tests/actors/serve/test_serve_api.py checks serve against launch token for token.
@pytest.mark.slow
def test_a_tiny_bench_against_the_real_server_matches_the_launch_token_for_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "serve.json"
    argv = ["bench", "serve", "--workloads", "unique", "--rates", "inf", "--requests", "3"]
    argv += ["--burst", "0", "--set", "model.preset=tiny"]
    for setting in QUICK:  # a faster heartbeat and stop, as the launch tests use
        argv += ["--set", setting]
    assert cli.main([*argv, "--json", str(path)]) == 0, capsys.readouterr().err
    result = orjson.loads(path.read_bytes())
    (row,) = result["rows"]
    assert (
        row["serve"]["requests"]
        == row["launch"]["requests"]
        == {
            "total": 3,
            "finished": 3,
            "failed": 0,
        }
    )
    assert row["serve"]["output_tokens"] == row["launch"]["output_tokens"] > 0
    assert row["tokens_match"] == 1.0  # greedy, the same model: the same tokens
    assert row["ratios"]["ttft_p50"] > 0 and row["ratios"]["output_tokens_per_s"] > 0
    assert row["serve"]["leaked_names"] == [] and result["burst"] is None
    assert row["serve"]["frontend_cpu_s_per_token"] >= 0  # read from the real front end's pid

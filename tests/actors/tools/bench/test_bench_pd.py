"""``ringfence bench pd``: its router process over fake instances, the hand-over's figures
from log lines, the report over fake sides, and once end to end on real instances (slow;
CI checks the real logs' figures in tests/actors/router/test_pd_runs.py)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from fake_instance import FakeInstance, Knobs
from launching import QUICK

from ringfence.actors.tools.bench import launcher
from ringfence.actors.tools.bench.serving import pd as bench_pd
from ringfence.actors.tools.bench.serving import server
from ringfence.actors.tools.bench.serving.client import LoadRequest
from ringfence.actors.tools.bench.serving.handover import (
    lane_cost,
    routed_cost,
    router_lines,
    visible_cost,
)
from ringfence.actors.tools.bench.serving.server import Routed
from ringfence.actors.tools.bench.serving.stats import Timeline
from ringfence.runtime import cli

START_S = 60.0


@pytest.fixture
def pair() -> Iterator[tuple[FakeInstance, FakeInstance]]:
    prefill = FakeInstance("p", Knobs(role="prefill")).start()
    decode = FakeInstance("d", Knobs(role="decode")).start()
    yield prefill, decode
    prefill.stop()
    decode.stop()


def test_routed_runs_ringfence_router_whose_log_holds_each_answer(tmp_path: Path, pair) -> None:
    prefill, decode = pair
    with Routed(tmp_path, [prefill.url], [decode.url], start_timeout=START_S) as router:
        assert router.url.startswith("http://127.0.0.1:")
        body = {"prompt": list(range(40)), "max_tokens": 3}
        answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=30.0)
        assert answer.status_code == 200, answer.text
        assert router.stop(deadline_s=30.0) == []
    assert router.proc.returncode == 0
    assert [c.path for c in prefill.calls][-1] == "/ringfence/prefill"
    found = routed_cost(router_lines(router.log_path))
    assert found["requests"] == 1 and found["outcomes"] == {"ok": 1}
    assert found["stored_blocks"] == 40 // 16 and found["fallbacks"] == {}


def test_a_router_that_refuses_its_instances_is_a_run_error_quoting_why(
    tmp_path: Path, pair
) -> None:
    prefill, decode = pair
    decode.knobs.fingerprints = ("other",)
    with pytest.raises(launcher.RunError, match=r"(?s)ringfence router exited \(status 2\).*"
                       r"cannot share KV: their fingerprints differ"):  # fmt: skip
        Routed(tmp_path, [prefill.url], [decode.url], start_timeout=START_S)


def done(op: int, direction: str, blocks: int, copy_ns: int, **extra: Any) -> dict[str, Any]:
    return {"event": "lane.done", "lane": "store", "op": op, "direction": direction,
            "status": "ok", "blocks": blocks, "copy_ns": copy_ns, "wait_ns": 1_000_000,
            "missing": [], **extra}  # fmt: skip


def test_a_lanes_cost_counts_its_ok_ops_of_one_direction_per_block() -> None:
    lines = [
        done(1, "write", 4, 4_000_000),
        done(2, "write", 2, 8_000_000),
        done(3, "write", 9, 1, status="failed"),  # failed: no blocks moved
        done(4, "read", 3, 3_000_000, missing=[2]),
        {**done(5, "write", 9, 1), "lane": "swap"},  # another lane
        {"event": "lane.start", "lane": "store", "direction": "write", "blocks": 9},
    ]
    write = lane_cost(lines, "write")
    assert (write["ops"], write["blocks"], write["missing"]) == (2, 6, 0)
    assert write["us_per_block"] == pytest.approx(12_000 / 6)
    assert write["copy_ms"]["p50"] == pytest.approx(6.0) and write["wait_ms"]["p50"] == 1.0
    read = lane_cost(lines, "read")
    assert (read["ops"], read["blocks"], read["missing"]) == (1, 3, 1)
    assert read["us_per_block"] == pytest.approx(1_000)
    assert lane_cost([], "read")["us_per_block"] is None


def test_the_visible_cost_is_the_held_finishes_wait_per_request_and_per_block() -> None:
    lines = [
        {"event": "handover.hold", "request": "a", "blocks": 4},
        {"event": "handover.done", "request": "a", "blocks": 4, "wait_ms": 8.0},
        {"event": "handover.done", "request": "b", "blocks": 0, "wait_ms": 2.0},
    ]
    found = visible_cost(lines)
    assert (found["requests"], found["blocks"]) == (2, 4)
    assert found["ms_per_block"] == pytest.approx(10.0 / 4)
    assert found["wait_ms"]["p50"] == pytest.approx(5.0)


def test_the_routers_log_skips_lines_that_are_not_its_json(tmp_path: Path) -> None:
    path = tmp_path / "router.jsonl"
    answered = {"event": "router.answered", "outcome": "ok", "prefill_s": 0.5, "claims": 2,
                "retries": 3, "fallback": "timeout", "stored_blocks": 7}  # fmt: skip
    path.write_bytes(
        b"WARNING: a library's line\n" + orjson.dumps(answered) + b"\n{broken\n"
        + orjson.dumps({"event": "router.started"}) + b"\n"
    )  # fmt: skip
    lines = router_lines(path)
    assert [line["event"] for line in lines] == ["router.answered", "router.started"]
    found = routed_cost(lines)
    assert found["fallbacks"] == {"timeout": 1} and found["reserve_retries"] == 3
    assert found["reclaimed"] == 1 and found["stored_blocks"] == 7
    with pytest.raises(launcher.RunError, match="router's log"):
        router_lines(tmp_path / "missing.jsonl")


def fake_timelines(requests: Sequence[LoadRequest], gap_s: float, storage: int) -> list[Timeline]:
    """Each request answered at its arrival: a first token after 0.1 s, then one every
    ``gap_s``; the usage says ``storage`` prompt tokens came from the tier."""
    out = []
    for r in requests:
        sent = r.arrival_s
        chunks = tuple(sent + 0.1 + gap_s * i for i in range(r.max_tokens))
        usage = {"prompt_tokens": len(r.prompt_token_ids),
                 "ringfence": {"cached_tokens": {"storage": storage}}}  # fmt: skip
        out.append(Timeline(
            id=r.id, sent_s=sent, chunk_s=chunks, chunk_tokens=(1,) * r.max_tokens,
            end_s=chunks[-1], token_ids=tuple(range(r.max_tokens)), usage=usage,
        ))  # fmt: skip
    return out


def fake_handover(blocks: int) -> dict[str, Any]:
    return {
        "write": {"ops": 1, "blocks": blocks, "missing": 0, "us_per_block": 100.0},
        "visible": {"requests": 1, "blocks": blocks, "wait_ms": {"p50": 5.0}, "ms_per_block": 1.0},
        "prefetched": {"ops": 1, "blocks": blocks, "missing": 0, "us_per_block": 50.0},
        "router": {"outcomes": {"ok": 2}, "fallbacks": {}, "reserve_retries": 0, "reclaimed": 0,
                   "prefill_s": {"p50": 0.2}},
    }  # fmt: skip


def test_a_bench_over_fake_sides_reports_each_class_its_ratios_and_the_hand_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, Path]] = []

    def side(name: str, gap_s: float, storage: int) -> Any:
        def run(requests, settings, folder, timeout) -> dict[str, Any]:
            calls.append((name, folder))
            found = {"timelines": fake_timelines(requests, gap_s, storage), "start": 0.0,
                     "leaked_names": []}  # fmt: skip
            return found | ({"handover": fake_handover(10)} if name == "pd" else {})

        return run

    monkeypatch.setattr(
        bench_pd, "SIDES", {"both": side("both", 0.04, 0), "pd": side("pd", 0.02, 16)}
    )
    path = tmp_path / "pd.json"
    argv = ["bench", "pd", "--requests", "8", "--rounds", "2", "--json", str(path)]
    assert cli.main(argv) == 0
    assert [name for name, _ in calls] == ["both", "pd", "both", "pd"]
    assert len({folder for _, folder in calls}) == 4  # fresh each time
    result = orjson.loads(path.read_bytes())
    assert [row["class"] for row in result["rows"]] == ["long", "stream", "all"]
    assert [row["requests"] for row in result["rows"]] == [6, 2, 8]
    for row in result["rows"]:
        assert row["ratios"]["itl_p50"] == pytest.approx(0.5)
        assert row["ratios"]["ttft_p50"] == pytest.approx(1.0)
    assert result["tokens_match"] == 1.0
    assert result["handover"]["write"] == 100.0 and result["handover"]["prefetched"] == 50.0
    assert len(result["rounds"]) == 2 and (tmp_path / "pd.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "pd/both" in out and "hand-over: write 100 us/block" in out


def test_a_failed_request_or_a_leaked_name_makes_the_bench_fail(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def side(requests, settings, folder, timeout) -> dict[str, Any]:
        timelines = fake_timelines(requests, 0.01, 0)
        timelines[0] = Timeline(id=timelines[0].id, sent_s=0.0, chunk_s=(), chunk_tokens=(),
                                end_s=1.0, error="HTTP 502: decode_failed")  # fmt: skip
        return {"timelines": timelines, "start": 0.0, "leaked_names": ["/rf_x_engine"],
                "handover": fake_handover(1)}  # fmt: skip

    monkeypatch.setattr(bench_pd, "SIDES", {"both": side, "pd": side})
    assert cli.main(["bench", "pd", "--requests", "4", "--plot", str(tmp_path / "p.png")]) == 1
    err = capsys.readouterr().err
    assert "round 0 pd: 1 request(s) failed: ['HTTP 502: decode_failed']" in err
    assert "round 0 both: left ['/rf_x_engine'] in /dev/shm" in err


def test_the_pd_sides_workers_split_the_cpus_unless_a_set_says_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: dict[str, list[str]] = {}

    class Recorded:
        def __init__(self, run_dir: Path, settings: list[str], **kwargs: Any) -> None:
            started[run_dir.name] = list(settings)
            raise launcher.RunError("recorded")

    monkeypatch.setattr(server, "Served", Recorded)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert bench_pd.pd_threads() == 4
    with pytest.raises(launcher.RunError, match="recorded"):
        bench_pd.pd_side([], ["model.preset=small", "actors.worker.threads=3"], tmp_path, 1.0)
    for role in ("prefill", "decode"):
        sets = started[role]
        assert sets.index("actors.worker.threads=4") < sets.index("actors.worker.threads=3")
        assert f"engine.role={role}" in sets
    assert "sched.preemption=save" in started["decode"]


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--workload", "nope"], "--workload: unknown 'nope'"),
        (["--requests", "0"], "--requests must be >= 1"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--set", "engine.role=decode"], "--set engine.role=decode: each side sets engine.role"),
    ],
)
def test_bad_options_are_refused_naming_the_option(argv, named, capsys) -> None:
    assert cli.main(["bench", "pd", *argv]) == 2
    assert named in capsys.readouterr().err


# Slow (four real instance processes and a router, twice): the figures it reads from real
# logs are checked in CI by tests/actors/router/test_pd_runs.py.
@pytest.mark.slow
def test_a_tiny_bench_on_real_instances_gives_the_same_tokens_from_the_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "pd.json"
    argv = ["bench", "pd", "--requests", "4", "--rounds", "1", "--json", str(path)]
    for setting in ("model.preset=tiny", "model.dtype=float64", *QUICK):
        argv += ["--set", setting]
    assert cli.main(argv) == 0, capsys.readouterr().err
    result = orjson.loads(path.read_bytes())
    assert result["tokens_match"] == 1.0  # float64, greedy: the hand-over changes no token
    assert result["from_tier"] > 0.9  # every full block but the last token's
    (last,) = result["rounds"]
    # A prompt whose length is a multiple of the block size leaves its last block to compute.
    assert last["handover"]["write"]["blocks"] >= last["handover"]["prefetched"]["blocks"] > 0
    assert last["handover"]["router"]["outcomes"] == {"ok": 4}
    assert last["leaked_names"] == {"both": [], "pd": []}

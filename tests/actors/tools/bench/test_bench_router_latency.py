"""``ringfence bench router-latency`` (actors/tools/bench/serving/router_latency.py): its
prompts and bodies, the rounds that alternate the sides, the report's added latency and
verdict, the option checks; and its quick form on real processes (three stubs, a router per
policy), every request answered and every process it started gone. No figure is compared
with a wall-clock bound: the target is informational."""

from __future__ import annotations

import argparse
from pathlib import Path

import orjson
import pytest

from ringfence.actors.tools.bench.serving import latency_report, router_latency, server
from ringfence.actors.tools.bench.serving.latency_load import (
    Sample,
    Shape,
    body_of,
    prompts,
    rounds_of,
    side_order,
)
from ringfence.runtime import cli


def test_prompts_share_one_of_the_heads_and_are_ascii_letters_so_text_is_the_same_ids():
    drawn = prompts(40, prompt_tokens=64, prefixes=3, seed=7)
    assert drawn == prompts(40, prompt_tokens=64, prefixes=3, seed=7)
    assert drawn != prompts(40, prompt_tokens=64, prefixes=3, seed=8)
    assert {len(p) for p in drawn} == {64}
    assert len({tuple(p[:48]) for p in drawn}) == 3  # three quarters: one of the heads
    assert len({tuple(p[48:]) for p in drawn}) == 40
    assert all(ord("a") <= t <= ord("z") for p in drawn for t in p)


def test_a_body_sends_the_same_prompt_as_ids_text_or_a_chat():
    ids = [104, 105]
    as_ids = orjson.loads(body_of(ids, Shape(prompt="ids", stream=False), max_tokens=3))
    assert as_ids == {"model": "stub", "max_tokens": 3, "temperature": 0, "prompt": [104, 105]}
    as_text = orjson.loads(body_of(ids, Shape(prompt="text", stream=True), max_tokens=3))
    assert as_text["prompt"] == "hi" and as_text["stream"] is True
    as_chat = orjson.loads(body_of(ids, Shape(prompt="chat", stream=False), max_tokens=3))
    assert as_chat["messages"] == [{"role": "user", "content": "hi"}] and "prompt" not in as_chat


def test_rounds_cut_the_requests_evenly_and_the_side_that_goes_first_alternates():
    assert rounds_of(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert rounds_of(3, 3) == [range(0, 1), range(1, 2), range(2, 3)]
    assert [side_order(n) for n in range(3)] == [
        ("direct", "router"), ("router", "direct"), ("direct", "router")
    ]  # fmt: skip
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        rounds_of(3, 0)


def samples(*ms: float, errors: int = 0) -> list[Sample]:
    return [Sample(m / 1000) for m in ms] + [Sample(9.0, "HTTP 500: b''")] * errors


def test_the_added_latency_is_the_router_minus_direct_at_each_percentile():
    direct = samples(*range(1, 101))  # 1..100 ms
    router = samples(*(m + 1.5 for m in range(1, 101)), errors=2)
    row = latency_report.row(policy="cache", concurrency=1, prompt="ids", stream=False,
                             sides={"direct": direct, "router": router},
                             routed_total_s=[0.001, 0.003], router_cpu_s=0.0012)  # fmt: skip
    assert row["direct"]["p50_s"] == pytest.approx(0.0505)
    assert row["router"]["requests"] == 102 and row["router"]["failed"] == 2
    assert row["router"]["errors"] == ["HTTP 500: b''"]
    assert row["added"] == pytest.approx({"p50_s": 0.0015, "p90_s": 0.0015, "p99_s": 0.0015})
    assert row["target_met"] is True
    assert row["router_log_total"]["p50_s"] == pytest.approx(0.002)
    assert row["router_cpu_per_request_s"] == 0.0012
    verdict = latency_report.verdict([row])
    assert verdict == {
        "p99_added_under_s": 0.002,
        "met": True,
        "worst_p99_added_s": row["added"]["p99_s"],
    }


def test_the_target_is_judged_one_request_at_a_time_and_only_there():
    direct, later, queue = samples(*range(1, 101)), samples(*range(5, 105)), samples(*range(9, 109))
    slow = latency_report.row(policy="cache", concurrency=1, prompt="text", stream=True,
                              sides={"direct": direct, "router": later})  # fmt: skip
    queued = latency_report.row(policy="cache", concurrency=8, prompt="text", stream=True,
                                sides={"direct": direct, "router": queue})  # fmt: skip
    assert slow["added"]["p99_s"] == pytest.approx(0.004) and slow["target_met"] is False
    assert queued["added"]["p99_s"] == pytest.approx(0.008) and queued["target_met"] is None
    verdict = latency_report.verdict([slow, queued])
    assert verdict["met"] is False and verdict["worst_p99_added_s"] == pytest.approx(0.004)
    result = {"rows": [slow, queued], "target": verdict, "requests": 100, "warmup": 0, "cpus": 2}
    text = latency_report.table(result).splitlines()
    assert text[1].startswith("cache           1 text   sse ") and text[1].endswith("-  FAIL")
    assert text[2].startswith("cache           8 text   sse ") and text[2].endswith("-  -")
    assert "one request at a time: FAIL (worst added p99 at concurrency 1: 4.00 ms" in text[3]


def test_a_side_without_an_answered_request_has_no_percentiles_and_no_verdict():
    sides = {"direct": samples(1.0), "router": samples(errors=1)}
    row = latency_report.row(policy="round_robin", concurrency=1, prompt="ids", stream=False,
                             sides=sides)  # fmt: skip
    assert row["router"]["p99_s"] is None and row["added"]["p99_s"] is None
    assert row["target_met"] is None
    assert latency_report.verdict([row])["met"] is False


@pytest.mark.parametrize(
    "argv, message",
    [(["--policies", "cache,fastest"], "--policies: got \\['cache', 'fastest'\\]"),
     (["--prompts", "ids,ids"], "--prompts: got \\['ids', 'ids'\\]"),
     (["--answers", "xml"], "--answers"),
     (["--concurrency", "1,0"], "--concurrency: each must be >= 1"),
     (["--concurrency", "one"], "--concurrency: 'one' is not integers"),
     (["--requests", "0"], "--requests must be >= 1"),
     (["--warmup", "-1"], "--warmup must be >= 0"),
     (["--requests", "2", "--rounds", "3"], "--rounds must be <= --requests")],
)  # fmt: skip
def test_a_bad_option_is_named(argv, message):
    parser = argparse.ArgumentParser()
    router_latency.add_arguments(parser)
    parser.add_argument("--json")
    with pytest.raises(ValueError, match=message):
        router_latency.main(parser.parse_args(argv))


def test_the_quick_form_answers_every_request_directly_and_through_each_router(
    tmp_path: Path, monkeypatch
):
    started: list[server.Started] = []
    init = server.Started.__init__

    def recorded(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(server.Started, "__init__", recorded)
    out = tmp_path / "latency.json"
    status = cli.main([
        "bench", "router-latency", "--policies", "round_robin,cache", "--requests", "12",
        "--warmup", "2", "--rounds", "3", "--concurrency", "1,2", "--prompts", "ids,text",
        "--prompt-tokens", "40", "--json", str(out),
    ])  # fmt: skip
    result = orjson.loads(out.read_bytes())
    assert status == 0, result
    # Every process it started (three fresh stubs and a router per policy) has exited.
    assert len(started) == 8 and all(s.proc.poll() is not None for s in started)
    cells = [(r["policy"], r["concurrency"], r["prompt"], r["stream"]) for r in result["rows"]]
    assert cells == [
        (policy, concurrency, prompt, stream)
        for policy in ("round_robin", "cache") for concurrency in (1, 2)
        for prompt in ("ids", "text") for stream in (False, True)
    ]  # fmt: skip
    for row in result["rows"]:
        for side in ("direct", "router"):
            assert row[side]["requests"] == 12 and row[side]["failed"] == 0, row
            assert row[side]["p99_s"] >= row[side]["p50_s"] > 0
        assert set(row["added"]) == {"p50_s", "p90_s", "p99_s"}
        assert set(row["router_log_total"]) == {"p50_s", "p90_s", "p99_s"}
        assert row["target_met"] in ((True, False) if row["concurrency"] == 1 else (None,))
        assert row["router_cpu_per_request_s"] > 0
    policies = result["policies"]
    for policy in ("round_robin", "cache"):
        assert policies[policy]["routed"] == 8 * 14  # 8 cells of 2 warm-up and 12 requests
        assert sum(policies[policy]["per_instance"].values()) == 8 * 14
    assert policies["round_robin"]["per_instance"] == {"i0": 38, "i1": 37, "i2": 37}
    assert policies["round_robin"]["no_load"] == policies["cache"]["no_load"] == 0
    # The cache policy followed the stubs' events and found their blocks.
    assert policies["cache"]["no_events"] == 0 and policies["cache"]["with_cached_blocks"] > 0
    assert set(result["target"]) == {"p99_added_under_s", "met", "worst_p99_added_s"}

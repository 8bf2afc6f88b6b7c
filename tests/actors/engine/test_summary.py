"""The launch summary of a workload run: records, percentiles, summary, files, table and
progress."""

from __future__ import annotations

import io

import orjson
import pytest

from ringfence.actors.engine.percentiles import percentile
from ringfence.actors.engine.summary import (
    OUTPUTS_FILE,
    SUMMARY_FILE,
    Progress,
    RequestRecord,
    format_summary,
    summarize,
    write_run_report,
)


def make_record(
    id: str = "r0",
    *,
    prompt_tokens: int = 10,
    token_ids: tuple[int, ...] = (1, 2, 3),
    finish_reason: str = "length",
    error: str = "",
    arrival_s: float = 0.0,
    first_token_s: float | None = 0.5,
    finish_s: float | None = 1.5,
    cached_tokens: dict[str, int] | None = None,
    preemptions: int = 0,
    returning: bool = False,
) -> RequestRecord:
    return RequestRecord(
        id=id,
        prompt_tokens=prompt_tokens,
        token_ids=token_ids,
        finish_reason=finish_reason,
        error=error,
        arrival_s=arrival_s,
        first_token_s=first_token_s,
        finish_s=finish_s,
        cached_tokens=cached_tokens or {"device": 0, "host": 0, "storage": 0},
        preemptions=preemptions,
        returning=returning,
    )


def make_records() -> list[RequestRecord]:
    """Two finished requests, one aborted after one token by an error, one aborted before any."""
    return [
        make_record(
            "a",
            prompt_tokens=32,
            token_ids=(1, 2, 3, 4, 5),
            finish_reason="stop",
            arrival_s=0.0,
            first_token_s=0.1,
            finish_s=0.5,
            cached_tokens={"device": 16, "host": 0, "storage": 0},
            preemptions=1,
        ),
        make_record(
            "b",
            prompt_tokens=16,
            token_ids=(7, 8, 9),
            arrival_s=1.0,
            first_token_s=1.3,
            finish_s=1.5,
            cached_tokens={"device": 0, "host": 8, "storage": 4},
        ),
        make_record(
            "c",
            prompt_tokens=8,
            token_ids=(6,),
            finish_reason="abort",
            error="worker 0 died",
            arrival_s=1.0,
            first_token_s=1.5,
            finish_s=2.0,
        ),
        make_record(
            "d",
            prompt_tokens=24,
            token_ids=(),
            finish_reason="abort",
            arrival_s=1.5,
            first_token_s=None,
            finish_s=2.0,
        ),
    ]


def test_percentile_interpolates_linearly_between_the_closest_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4, positions 0..3
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5  # position 1.5
    assert percentile(values, 25) == pytest.approx(1.75)  # position 0.75
    assert percentile(values, 99) == pytest.approx(3.97)  # position 2.97
    assert percentile([10.0, 20.0, 30.0, 40.0, 50.0], 90) == pytest.approx(46.0)  # position 3.6
    assert percentile([7.0], 99) == 7.0


@pytest.mark.parametrize(
    ("values", "q", "message"),
    [([], 50, "no values"), ([1.0], -1, r"\[0, 100\]"), ([1.0], 100.5, r"\[0, 100\]")],
)
def test_percentile_of_no_values_or_q_out_of_range_is_a_value_error(values, q, message):
    with pytest.raises(ValueError, match=message):
        percentile(values, q)


def test_ttft_runs_from_arrival_and_tpot_spreads_the_rest_over_the_later_tokens():
    record = make_record(
        token_ids=(1, 2, 3, 4, 5), arrival_s=1.0, first_token_s=1.25, finish_s=2.25
    )
    assert record.ttft_s == pytest.approx(0.25)
    assert record.tpot_s == pytest.approx(0.25)  # 1.0 s over 4 tokens after the first


def test_ttft_and_tpot_are_none_without_the_tokens_they_need():
    one = make_record(token_ids=(1,), first_token_s=0.5, finish_s=0.5)
    none = make_record(token_ids=(), first_token_s=None, finish_s=1.0)
    assert (one.ttft_s, one.tpot_s) == (0.5, None)
    assert (none.ttft_s, none.tpot_s) == (None, None)


def test_a_record_with_an_unknown_finish_reason_or_tier_is_a_value_error():
    with pytest.raises(ValueError, match="done"):
        make_record(finish_reason="done")
    with pytest.raises(ValueError, match="disk"):
        make_record(cached_tokens={"disk": 1})


def test_a_json_line_has_the_design_fields_and_all_three_tiers():
    line = make_record(
        "x", token_ids=(5, 6), error="boom", finish_reason="abort", cached_tokens={"host": 3}
    ).to_json_line()
    assert line.endswith(b"\n")
    assert orjson.loads(line) == {
        "id": "x",
        "prompt_tokens": 10,
        "token_ids": [5, 6],
        "finish_reason": "abort",
        "error": "boom",
        "ttft_s": 0.5,
        "tpot_s": 1.0,
        "cached_tokens": {"device": 0, "host": 3, "storage": 0},
        "preemptions": 0,
        "returning": False,
    }
    assert "error" not in orjson.loads(make_record().to_json_line())


def test_summarize_counts_requests_tokens_rates_latencies_and_hits():
    engine = {"preemptions": {"swap": 1}, "steps": 12}
    summary = summarize(make_records(), duration_s=2.0, engine=engine)
    assert summary["requests"] == {"total": 4, "finished": 2, "aborted": 2, "errors": 1}
    assert summary["tokens"] == {"prompt": 80, "output": 9}
    assert summary["duration_s"] == 2.0
    # Throughput counts the requests that ended without an error: a, b and d (c's work is lost).
    assert summary["throughput"] == {
        "output_tokens_per_s": 4.0,
        "total_tokens_per_s": 40.0,
        "requests_per_s": 1.5,
    }
    # TTFT of a, b, c: 0.1, 0.3, 0.5 (d has no token); TPOT of a, b: 0.1, 0.1.
    ttft = summary["ttft_s"]
    assert ttft["p50"] == pytest.approx(0.3)
    assert ttft["p99"] == pytest.approx(0.496)
    assert ttft["mean"] == pytest.approx(0.3)
    assert summary["tpot_s"] == pytest.approx({"p50": 0.1, "p99": 0.1, "mean": 0.1})
    assert summary["cached_tokens"] == {"device": 16, "host": 8, "storage": 4}
    assert summary["hit_rate"] == {"device": 0.2, "host": 0.1, "storage": 0.05, "total": 0.35}
    assert summary["engine"] == engine
    assert summary["engine"] is not engine


def test_summarize_of_nothing_in_no_time_has_none_for_what_cannot_be_computed():
    summary = summarize([], duration_s=0.0, engine={})
    assert summary["requests"] == {"total": 0, "finished": 0, "aborted": 0, "errors": 0}
    assert summary["throughput"] == dict.fromkeys(
        ("output_tokens_per_s", "total_tokens_per_s", "requests_per_s")
    )
    assert summary["ttft_s"] == {"p50": None, "p99": None, "mean": None}
    assert summary["hit_rate"]["total"] is None
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], duration_s=-1.0, engine={})


def test_summarize_splits_ttft_into_first_and_returning_turns():
    records = [
        make_record("u0-t0", arrival_s=0.0, first_token_s=0.4),
        make_record("u1-t0", arrival_s=0.0, first_token_s=0.6),
        make_record("u0-t1", arrival_s=1.0, first_token_s=1.1, returning=True),
        make_record("u1-t1", arrival_s=1.0, first_token_s=1.2, returning=True),
        make_record("u0-t2", arrival_s=2.0, first_token_s=None, token_ids=(), returning=True),
    ]
    turns = summarize(records, duration_s=3.0, engine={})["ttft_by_turn"]
    assert turns["first"] == pytest.approx({"requests": 2, "p50": 0.5, "p95": 0.59})
    assert turns["returning"] == pytest.approx({"requests": 2, "p50": 0.15, "p95": 0.195})
    assert orjson.loads(records[2].to_json_line())["returning"] is True


def test_write_run_report_writes_both_files_that_round_trip_and_leaves_no_temporaries(tmp_path):
    records = make_records()
    summary = summarize(records, duration_s=2.0, engine={"bytes": {"swap_in": 1 << 20}})
    write_run_report(tmp_path, records, summary)
    lines = (tmp_path / OUTPUTS_FILE).read_bytes().splitlines()
    assert [orjson.loads(line)["id"] for line in lines] == ["a", "b", "c", "d"]
    assert [orjson.loads(line) for line in lines] == [
        orjson.loads(r.to_json_line()) for r in records
    ]
    text = (tmp_path / SUMMARY_FILE).read_text()
    assert text.startswith("{\n  ")  # indented
    assert orjson.loads(text) == summary
    assert sorted(p.name for p in tmp_path.iterdir()) == [OUTPUTS_FILE, SUMMARY_FILE]


def test_write_run_report_replaces_an_earlier_report(tmp_path):
    records = make_records()
    write_run_report(tmp_path, records, summarize(records, duration_s=1.0, engine={}))
    write_run_report(tmp_path, records[:1], summarize(records[:1], duration_s=1.0, engine={}))
    assert len((tmp_path / OUTPUTS_FILE).read_bytes().splitlines()) == 1
    assert orjson.loads((tmp_path / SUMMARY_FILE).read_bytes())["requests"]["total"] == 1


def test_format_summary_shows_the_key_figures():
    engine = {
        "preemptions": {"recompute": 3, "swap": 1},
        "bytes": {"swap_in": 3 << 20, "swap_out": 1 << 19},
    }
    text = format_summary(summarize(make_records(), duration_s=2.0, engine=engine))
    rows = {line[:11].strip(): line[13:] for line in text.splitlines()}
    assert rows["requests"] == "4 total, 2 finished, 2 aborted, 1 errors"
    assert rows["tokens"] == "80 prompt, 9 output"
    assert rows["duration"] == "2.000 s"
    assert rows["throughput"] == "4.0 output tok/s, 40.0 total tok/s, 1.50 req/s"
    assert rows["TTFT"] == "p50 300.0 ms, p99 496.0 ms"
    assert rows["TPOT"] == "p50 100.0 ms, p99 100.0 ms"
    assert rows["TTFT turns"] == (
        "p50/p95: first turns 300.0/480.0 ms, returning turns -/- ms (3 and 0 requests)"
    )
    assert rows["cache hits"] == "device 16 (20.0%), host 8 (10.0%), storage 4 (5.0%)"
    assert rows["preemptions"] == "recompute 3, swap 1"
    assert rows["bytes moved"] == "swap_in 3.0 MiB, swap_out 0.5 MiB"
    assert text.splitlines()[-1] == "1 request failed: worker 0 died"  # c's, under the table


def test_format_summary_aligns_its_labels_and_survives_missing_figures():
    text = format_summary({"engine": {"bytes": {"host": {"in": 1 << 20}}, "preemptions": 7}})
    # The labels are padded to the longest ("preemptions", "bytes moved"), then two spaces.
    assert all(line[11:13] == "  " and line[13] != " " for line in text.splitlines())
    assert "TTFT         p50 - ms, p99 - ms" in text
    assert (
        "TTFT turns   p50/p95: first turns -/- ms, returning turns -/- ms (- and - requests)"
        in text
    )
    assert "preemptions  none" in text
    assert "bytes moved  host.in 1.0 MiB" in text
    assert format_summary({})  # no figures at all is still a table


class FakeStream(io.StringIO):
    def __init__(self, *, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_on_a_log_writes_at_most_one_line_per_interval_and_always_the_last():
    stream = FakeStream(tty=False)
    progress = Progress(4, stream=stream, min_interval_s=1.0)
    progress.update(0, 10.0, tokens=0)
    progress.update(1, 10.4, tokens=40)  # too soon
    progress.update(2, 11.0, tokens=100)
    progress.update(3, 11.5, tokens=150)  # too soon
    progress.update(4, 11.6, tokens=160)  # the last is always written
    progress.update(4, 11.7, tokens=160)  # but only once
    progress.close()
    assert stream.getvalue().splitlines() == [
        "0/4 requests, 0 tokens, - tok/s",
        "2/4 requests, 100 tokens, 100.0 tok/s",
        "4/4 requests, 160 tokens, 100.0 tok/s",
    ]


def test_progress_on_a_tty_rewrites_one_line_in_place_and_close_ends_it():
    stream = FakeStream(tty=True)
    progress = Progress(2, stream=stream, min_interval_s=0.5, start=0.0)
    progress.update(1, 1.0, tokens=1000)
    progress.update(2, 2.0, tokens=1000)
    progress.close()
    progress.close()
    assert stream.getvalue() == (
        "\r1/2 requests, 1000 tokens, 1000.0 tok/s"
        "\r2/2 requests, 1000 tokens, 500.0 tok/s "  # padded over the longer line
        "\n"
    )

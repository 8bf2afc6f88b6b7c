"""``ringfence bench serve``'s arithmetic on fake event timelines: seeded Poisson arrivals,
percentiles, and TTFT, ITL and TPOT from chunk times."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest

from ringfence.actors.engine.percentiles import stats
from ringfence.actors.tools.bench.serving.stats import (
    Timeline,
    busy_period,
    parse_rate,
    poisson_arrivals,
    rate_label,
    summarize,
)


def timeline(
    id: str, sent: float, chunks: list[float], tokens: list[int] | None = None, error: str = ""
) -> Timeline:
    counts = tokens if tokens is not None else [1] * len(chunks)
    return Timeline(
        id=id,
        sent_s=sent,
        chunk_s=tuple(chunks),
        chunk_tokens=tuple(counts),
        end_s=(chunks[-1] if chunks else sent) + 0.001,
        error=error,
    )


def test_the_same_seed_gives_the_same_arrivals_and_another_seed_other_ones() -> None:
    assert poisson_arrivals(2.0, 50, seed=7) == poisson_arrivals(2.0, 50, seed=7)
    assert poisson_arrivals(2.0, 50, seed=7) != poisson_arrivals(2.0, 50, seed=8)


def test_arrivals_start_at_zero_and_never_go_back() -> None:
    arrivals = poisson_arrivals(4.0, 100, seed=0)
    assert arrivals[0] == 0.0
    assert all(b > a for a, b in itertools.pairwise(arrivals))


def test_the_gaps_of_many_arrivals_average_one_over_the_rate() -> None:
    arrivals = poisson_arrivals(5.0, 20_001, seed=3)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean (a fixed step would give 0).
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.05)


def test_an_infinite_rate_sends_everything_at_once() -> None:
    assert poisson_arrivals(math.inf, 5, seed=0) == [0.0] * 5


def test_each_rate_draws_its_own_arrivals() -> None:
    one, two = poisson_arrivals(1.0, 20, seed=0), poisson_arrivals(2.0, 20, seed=0)
    assert [2 * t for t in two] != pytest.approx(one)


@pytest.mark.parametrize("text", ["0", "-1", "nan", "fast", ""])
def test_a_rate_that_is_not_positive_is_refused_naming_the_option(text: str) -> None:
    with pytest.raises(ValueError, match="--rates"):
        parse_rate(text)


def test_rates_parse_and_print_as_written() -> None:
    assert [rate_label(parse_rate(t)) for t in ("inf", "2", "0.5", "2.0")] == [
        "inf",
        "2",
        "0.5",
        "2",
    ]


def test_percentiles_interpolate_between_ranks_and_the_mean_is_exact() -> None:
    assert stats([4.0, 1.0, 3.0, 2.0]) == {"p50": 2.5, "p99": pytest.approx(3.97), "mean": 2.5}
    assert stats([]) == {"p50": None, "p99": None, "mean": None}


def test_ttft_is_the_first_chunk_with_tokens_after_the_send() -> None:
    assert timeline("a", 10.0, [10.25, 10.5]).ttft_s == pytest.approx(0.25)
    assert timeline("b", 10.0, []).ttft_s is None


def test_itl_is_every_gap_between_token_chunks() -> None:
    assert timeline("a", 0.0, [1.0, 1.5, 1.75, 2.75]).itl_s == pytest.approx([0.5, 0.25, 1.0])


def test_tpot_spreads_the_time_after_the_first_token_over_the_later_tokens() -> None:
    # 1 + 2 + 3 tokens in three chunks: 5 tokens after the first, over 1.0 s.
    assert timeline("a", 0.0, [1.0, 1.5, 2.0], [1, 2, 3]).tpot_s == pytest.approx(0.2)
    assert timeline("b", 0.0, [1.0]).tpot_s is None


def test_a_timeline_whose_chunks_go_backwards_or_carry_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="backwards"):
        timeline("a", 0.0, [2.0, 1.0])
    with pytest.raises(ValueError, match="carries no token"):
        timeline("a", 0.0, [1.0], [0])
    with pytest.raises(ValueError, match="2 chunk times but 1"):
        timeline("a", 0.0, [1.0, 2.0], [1])


def test_a_run_summary_counts_failures_apart_and_rates_over_the_busy_period() -> None:
    timelines = [
        timeline("a", 0.0, [0.1, 0.2, 0.3]),
        timeline("b", 0.5, [0.9, 1.0, 1.1, 1.9]),
        timeline("c", 1.0, [], error="HTTP 400: bad"),
    ]
    assert busy_period(timelines, start_s=0.0) == pytest.approx(1.901)
    summary = summarize(timelines, duration_s=2.0)
    assert summary["requests"] == {"total": 3, "finished": 2, "failed": 1}
    assert summary["output_tokens"] == 7
    assert summary["throughput"] == {"requests_per_s": 1.0, "output_tokens_per_s": 3.5}
    assert summary["ttft_s"]["p50"] == pytest.approx(0.25)  # of 0.1 and 0.4
    assert summary["tpot_s"]["p50"] == pytest.approx((0.1 + 1.0 / 3) / 2)
    assert summary["itl_s"]["p50"] == pytest.approx(0.1)  # of 0.1, 0.1, 0.1, 0.1, 0.8
    assert summary["itl_s"]["mean"] == pytest.approx(1.2 / 5)
    assert summary["errors"] == ["HTTP 400: bad"]


def test_a_run_of_no_time_has_no_rates() -> None:
    assert summarize([], duration_s=0.0)["throughput"] == {
        "requests_per_s": None,
        "output_tokens_per_s": None,
    }

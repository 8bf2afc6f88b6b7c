"""A run's errors grouped by kind, each with the setting to change; throughput counts only
what was computed (the launched runs are in test_run_explains.py)."""

from __future__ import annotations

import pytest
from test_summary import make_record  # type: ignore[import-not-found]  # the sibling module, by pytest

from ringfence.actors.engine.run_errors import error_lines, group_errors
from ringfence.actors.engine.summary import format_summary, summarize
from ringfence.sched.config import SchedulerConfig, TierConfig
from ringfence.sched.request import Request, RequestError, SamplingParams
from ringfence.sched.scheduler import Scheduler


def scheduler(*, device_blocks: int = 6, max_model_len: int = 1 << 30) -> Scheduler:
    tiers = TierConfig(
        block_size=16, device_blocks=device_blocks, host_blocks=1, host_cache=False, storage=False
    )
    config = SchedulerConfig(
        tiers=tiers, namespace=b"\0" * 16, max_model_len=max_model_len, vocab_size=256
    )
    return Scheduler(config, None)


def refusal(sched: Scheduler, request_id: str, prompt: list[int], max_tokens: int) -> str:
    """The scheduler's own message refusing the request."""
    params = SamplingParams(max_tokens=max_tokens)
    with pytest.raises(RequestError) as refused:
        sched.add(Request(request_id=request_id, prompt_token_ids=tuple(prompt), params=params))
    return str(refused.value)


def refused(request_id: str, prompt_tokens: int, error: str):
    return make_record(
        request_id,
        prompt_tokens=prompt_tokens,
        token_ids=(),
        finish_reason="abort",
        error=error,
        first_token_s=None,
    )


def test_refusals_past_the_device_pool_are_one_kind_shown_by_the_largest_with_its_setting():
    sched = scheduler(device_blocks=6)
    records = [refused(f"r{n}", n, refusal(sched, f"r{n}", [1] * n, 4)) for n in (100, 1_513, 140)]
    assert group_errors(records) == [
        {
            "kind": "device_pool",
            "requests": 3,
            "refused": True,
            "examples": 3,
            "text": "a prompt of 1,513 tokens plus max_tokens 4 needs 95 blocks, "
            "the device pool has 6",
            "setting": "cache.device_blocks",
        }
    ]
    assert error_lines(group_errors(records)) == [
        "3 requests refused, the largest: a prompt of 1,513 tokens plus max_tokens 4 needs "
        "95 blocks, the device pool has 6 (cache.device_blocks)"
    ]


def test_each_refusal_of_the_scheduler_is_read_as_its_kind_with_the_setting_to_change():
    sched = scheduler(device_blocks=1000, max_model_len=2040)
    records = [
        refused("long", 2030, refusal(sched, "long", [7] * 2030, 16)),
        refused("vocab", 3, refusal(sched, "vocab", [1, 300, 2], 4)),
    ]
    assert error_lines(group_errors(records)) == [
        "1 request refused: a prompt of 2,030 tokens plus max_tokens 16 is 2,046 tokens, more "
        "than max_model_len 2,040 (sched.max_model_len)",
        "1 request refused: prompt token 300 is outside the model's vocabulary of 256 "
        "(model.path: the model the workload's token ids were made for)",
    ]


def test_other_errors_group_by_their_text_without_numbers_most_requests_first():
    records = [
        make_record("a", finish_reason="abort", error="step 12 failed: worker-0 died"),
        make_record("b", finish_reason="abort", error="step 40 failed: worker-0 died"),
        make_record("c", finish_reason="abort", error="messages: no chat template"),
        make_record("d"),  # no error
    ]
    assert error_lines(group_errors(records)) == [
        "2 requests failed, the first: step 12 failed: worker-0 died",
        "1 request failed: messages: no chat template",
    ]


def test_a_run_of_refusals_only_has_zero_throughput_and_says_why_under_its_table():
    sched = scheduler(device_blocks=6)
    records = [refused(f"r{i}", 200, refusal(sched, f"r{i}", [1] * 200, 4)) for i in range(8)]
    summary = summarize(records, duration_s=0.002, engine={})
    assert summary["throughput"] == {
        "output_tokens_per_s": 0.0,
        "total_tokens_per_s": 0.0,
        "requests_per_s": 0.0,
    }
    assert summary["tokens"] == {"prompt": 1600, "output": 0}  # what the workload asked
    lines = format_summary(summary).splitlines()
    assert lines[3] == "throughput   0.0 output tok/s, 0.0 total tok/s, 0.00 req/s"
    assert lines[-1] == (
        "8 requests refused: a prompt of 200 tokens plus max_tokens 4 needs 13 blocks, "
        "the device pool has 6 (cache.device_blocks)"
    )


def test_a_mixed_run_counts_only_the_requests_that_ran():
    sched = scheduler(device_blocks=6)
    fine = [make_record(f"ok{i}", prompt_tokens=20, token_ids=(1, 2, 3, 4)) for i in range(3)]
    records = [*fine, refused("big", 500, refusal(sched, "big", [1] * 500, 4))]
    summary = summarize(records, duration_s=2.0, engine={})
    assert summary["throughput"] == {
        "output_tokens_per_s": 6.0,  # 12 tokens in 2 s
        "total_tokens_per_s": 36.0,  # (60 prompt + 12 output) in 2 s; the 500 never ran
        "requests_per_s": 1.5,
    }
    assert summary["requests"] == {"total": 4, "finished": 3, "aborted": 1, "errors": 1}
    assert [kind["kind"] for kind in summary["error_kinds"]] == ["device_pool"]


def test_a_run_without_errors_prints_nothing_under_its_table():
    summary = summarize([make_record("a"), make_record("b")], duration_s=1.0, engine={})
    assert summary["error_kinds"] == []
    assert format_summary(summary).splitlines()[-1].startswith("bytes moved")


def test_error_lines_skip_what_is_not_a_kind_of_the_summary():
    assert error_lines(None) == []
    assert error_lines("text") == []
    assert error_lines([{"requests": "many"}, 3]) == []

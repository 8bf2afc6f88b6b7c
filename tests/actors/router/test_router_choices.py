"""An n > 1 request through prefill and decode instances (actors/router/choices.py): which
requests the router splits, and how the choices' answers become one (the runs on real
instances are in test_pd_runs.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from ringfence.actors.router.choices import Merge, choices_of


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": 16}}  # fmt: skip


@pytest.mark.parametrize(
    ("n", "split"), [(2, 2), (128, 128), (1, 1), (None, 1), (129, 1), ("2", 1), (True, 1)]
)
def test_only_a_valid_n_above_one_is_split_into_claims(n, split):
    assert choices_of({} if n is None else {"n": n}) == split


def test_whole_answers_merge_their_choices_in_order_and_count_the_prompt_once():
    merge = Merge(2)
    merge.body(1, orjson.dumps({"id": "b", "choices": [{"index": 1, "text": "y"}],
                                "usage": usage(40, 5)}))  # fmt: skip
    merge.body(0, orjson.dumps({"id": "a", "choices": [{"index": 0, "text": "x"}],
                                "usage": usage(40, 3)}))  # fmt: skip
    whole = merge.whole()
    assert whole["id"] == "a"
    assert whole["choices"] == [{"index": 0, "text": "x"}, {"index": 1, "text": "y"}]
    assert whole["usage"] == {"prompt_tokens": 40, "completion_tokens": 8, "total_tokens": 48,
                              "prompt_tokens_details": {"cached_tokens": 16}}  # fmt: skip


def test_streamed_events_take_the_first_id_and_one_usage_chunk_ends_the_stream():
    merge = Merge(2)
    first = merge.event(1, {"id": "b", "choices": [{"index": 1, "text": "y"}]})
    second = merge.event(0, {"id": "a", "choices": [{"index": 0, "text": "x"}]})
    assert first is not None and second is not None
    assert (first["id"], second["id"]) == ("b", "b")
    assert merge.event(0, {"id": "a", "choices": [], "usage": usage(40, 3)}) is None
    assert merge.event(1, {"id": "b", "choices": [], "usage": usage(40, 5)}) is None
    last = merge.end()
    assert last is not None and last["id"] == "b" and last["choices"] == []
    assert last["usage"]["completion_tokens"] == 8 and last["usage"]["total_tokens"] == 48


def test_continuous_usage_on_every_chunk_is_the_sum_so_far():
    merge = Merge(2)
    chunk = merge.event(0, {"id": "a", "choices": [{"index": 0}], "usage": usage(40, 1)})
    assert chunk is not None and chunk["usage"]["completion_tokens"] == 1
    chunk = merge.event(1, {"id": "b", "choices": [{"index": 1}], "usage": usage(40, 2)})
    assert chunk is not None and chunk["usage"]["completion_tokens"] == 3
    assert chunk["usage"]["prompt_tokens"] == 40 and merge.end() is None  # no usage chunk asked

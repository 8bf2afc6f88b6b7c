"""Workloads: JSON-lines parsing with errors that point at the line and key, synthetic sets."""

from __future__ import annotations

import itertools
import json

import pytest

from ringfence.sched.request import RequestError, SamplingParams
from ringfence.sched.synthetic import CHAT_SYSTEM_TOKENS as SYSTEM
from ringfence.sched.synthetic import SYNTHETIC, describe, synthetic
from ringfence.sched.workload import (
    WorkloadError,
    WorkloadRequest,
    parse_workload,
    returning_turns,
)
from ringfence.shm.errors import RingfenceError


def line(**fields: object) -> str:
    return json.dumps(fields)


def parse_one(text: str) -> WorkloadRequest:
    (request,) = parse_workload([text], source="w.jsonl")
    return request


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


# Parsing


def test_every_field_of_a_line_round_trips_into_the_request():
    request = parse_one(
        line(
            id="q1",
            prompt_token_ids=[5, 0, 255],
            max_tokens=7,
            temperature=0.5,
            top_p=0.9,
            seed=3,
            stop_token_ids=[1, 2],
            arrival_s=1.25,
            session="chat-7",
        )
    )
    assert request == WorkloadRequest(
        id="q1",
        prompt_token_ids=(5, 0, 255),
        prompt=None,
        params=SamplingParams(
            max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop_token_ids=(1, 2)
        ),
        arrival_s=1.25,
        session="chat-7",
    )
    assert isinstance(request.params.stop_token_ids, tuple)


def test_a_chat_line_carries_its_messages_unrendered_with_their_extra_keys():
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "héllo", "name": "ana"},
    ]
    request = parse_one(line(id="c", messages=chat, max_tokens=3))
    assert request.messages == tuple(chat)
    assert (request.prompt, request.prompt_token_ids) == (None, None)
    assert request.params == SamplingParams(max_tokens=3)


def test_a_text_prompt_with_only_an_id_gets_the_default_params_and_arrival_0():
    request = parse_one(line(id="t", prompt="héllo"))
    assert (request.prompt, request.prompt_token_ids) == ("héllo", None)
    assert request.params == SamplingParams()
    assert request.arrival_s == 0.0


def test_bytes_lines_and_one_whole_text_parse_like_str_lines_and_blank_lines_are_skipped():
    lines = [line(id="a", prompt="x"), "", "   ", line(id="b", prompt_token_ids=[1])]
    expected = parse_workload(lines)
    assert [r.id for r in expected] == ["a", "b"]
    assert parse_workload([x.encode() for x in lines]) == expected
    assert parse_workload("\n".join(lines)) == expected
    assert parse_workload("\n".join(lines).encode()) == expected
    assert parse_workload([]) == []


def test_requests_are_sorted_by_arrival_and_then_by_line_order():
    lines = [
        line(id="late", prompt="x", arrival_s=2),
        line(id="first-at-1", prompt="x", arrival_s=1),
        line(id="zero", prompt="x"),
        line(id="second-at-1", prompt="x", arrival_s=1.0),
    ]
    assert [r.id for r in parse_workload(lines)] == ["zero", "first-at-1", "second-at-1", "late"]


@pytest.mark.parametrize(
    ("text", "key", "message"),
    [
        ('{"id": "a", "promt": "x"}', "promt", r"promt: unknown key \(did you mean prompt\?\)$"),
        ('{"id": "a", "prompt": "x", "zzz": 1}', "zzz", r"zzz: unknown key$"),
        ('{"prompt": "x"}', "id", r"id: missing$"),
        (
            '{"id": "a"}',
            "prompt",
            r"prompt: give exactly one of prompt, prompt_token_ids and messages$",
        ),
        (
            '{"id": "a", "prompt": "x", "prompt_token_ids": [1]}',
            "prompt",
            r"prompt: give exactly one of prompt, prompt_token_ids and messages$",
        ),
        ('{"id": 3, "prompt": "x"}', "id", r"id must be a non-empty string, got 3$"),
        ('{"id": "", "prompt": "x"}', "id", r"id must be a non-empty string, got ''$"),
        ('{"id": "a", "prompt": ""}', "prompt", r"prompt must be a non-empty string, got ''$"),
        ('{"id": "a", "prompt": 5}', "prompt", r"prompt must be a non-empty string, got 5$"),
        (
            '{"id": "a", "prompt_token_ids": []}',
            "prompt_token_ids",
            r"prompt_token_ids must not be empty$",
        ),
        (
            '{"id": "a", "prompt_token_ids": [1, -3]}',
            "prompt_token_ids",
            r"prompt_token_ids\[1\] must be a non-negative int token id, got -3$",
        ),
        (
            '{"id": "a", "prompt_token_ids": [1, 2.5]}',
            "prompt_token_ids",
            r"prompt_token_ids\[1\] must be a non-negative int token id, got 2\.5$",
        ),
        (
            '{"id": "a", "prompt_token_ids": "abc"}',
            "prompt_token_ids",
            r"prompt_token_ids must be a list of token ids, got str$",
        ),
        ('{"id": "a", "prompt": "x", "max_tokens": true}', "max_tokens", r"an int, got True$"),
        ('{"id": "a", "prompt": "x", "max_tokens": 0}', "max_tokens", r"must be >= 1, got 0$"),
        ('{"id": "a", "prompt": "x", "max_tokens": "8"}', "max_tokens", r"int, got '8'$"),
        ('{"id": "a", "prompt": "x", "seed": -4}', "seed", r"seed must be >= 0, got -4$"),
        ('{"id": "a", "prompt": "x", "seed": false}', "seed", r"seed must be an int, got False$"),
        ('{"id": "a", "prompt": "x", "temperature": -1}', "temperature", r">= 0, got -1$"),
        ('{"id": "a", "prompt": "x", "temperature": NaN}', "temperature", r">= 0, got nan$"),
        ('{"id": "a", "prompt": "x", "top_p": 0}', "top_p", r"top_p must be in \(0, 1\], got 0$"),
        ('{"id": "a", "prompt": "x", "top_p": 2.5}', "top_p", r"in \(0, 1\], got 2\.5$"),
        ('{"id": "a", "prompt": "x", "top_p": null}', "top_p", r"a number, got None$"),
        (
            '{"id": "a", "prompt": "x", "stop_token_ids": [true]}',
            "stop_token_ids",
            r"stop_token_ids\[0\] must be a non-negative int token id, got True$",
        ),
        (
            '{"id": "a", "prompt": "x", "stop_token_ids": 2}',
            "stop_token_ids",
            r"stop_token_ids must be a list of token ids, got int$",
        ),
        ('{"id": "a", "prompt": "x", "arrival_s": -1}', "arrival_s", r">= 0, got -1$"),
        ('{"id": "a", "prompt": "x", "arrival_s": "soon"}', "arrival_s", r"number, got 'soon'$"),
        ('{"id": "a", "prompt": "x", "id": "b"}', "id", r"id: key given twice$"),
        (
            '{"id": "a", "prompt": "x", "messages": [{"role": "user", "content": "x"}]}',
            "prompt",
            r"prompt: give exactly one of prompt, prompt_token_ids and messages$",
        ),
        ('{"id": "a", "messages": []}', "messages", r"messages must be a non-empty list"),
        ('{"id": "a", "messages": "hi"}', "messages", r"messages must be a non-empty list"),
        ('{"id": "a", "messages": ["hi"]}', "messages", r"messages\[0\] must be an object"),
        (
            '{"id": "a", "messages": [{"role": "user", "content": "x"}, {"content": "y"}]}',
            "messages",
            r"messages\[1\]\.role must be a non-empty string, got None$",
        ),
        (
            '{"id": "a", "messages": [{"role": "user", "content": 7}]}',
            "messages",
            r"messages\[0\]\.content must be a string, got 7$",
        ),
        ('{"id": "a", "prompt": "x"', None, r"invalid JSON: "),
        ('["id", "a"]', None, r"expected a JSON object, got list$"),
        (b'{"id": "a", "prompt": "\xff"}', None, r"not UTF-8: invalid start byte$"),
    ],
)
def test_a_bad_line_is_a_workload_error_naming_source_line_and_key(text, key, message):
    good = line(id="ok", prompt="x")
    with pytest.raises(WorkloadError, match=r"^w\.jsonl:3: .*" + message) as caught:
        parse_workload([good, "", text], source="w.jsonl")
    assert (caught.value.line, caught.value.key) == (3, key)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, RingfenceError)


def test_a_duplicate_id_names_both_lines():
    lines = [line(id="a", prompt="x"), line(id="b", prompt="x"), line(id="a", prompt="y")]
    with pytest.raises(
        WorkloadError, match=r"^<workload>:3: id: duplicate id 'a' \(first used on line 1\)$"
    ) as caught:
        parse_workload(lines)
    assert (caught.value.line, caught.value.key) == (3, "id")


def test_a_workload_request_needs_exactly_one_of_prompt_and_prompt_token_ids():
    with pytest.raises(RequestError, match="exactly one of prompt, prompt_token_ids and messages"):
        WorkloadRequest(id="a", prompt="x", prompt_token_ids=(1,), params=SamplingParams())
    with pytest.raises(RequestError, match="exactly one of prompt, prompt_token_ids and messages"):
        WorkloadRequest(id="a", prompt=None, prompt_token_ids=None, params=SamplingParams())


# Synthetic workloads


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_a_synthetic_workload_is_the_same_for_the_same_seed_and_differs_across_seeds(name):
    assert synthetic(name, seed=1) == synthetic(name, seed=1)
    assert synthetic(name, seed=1) != synthetic(name, seed=2)
    assert synthetic(name) == synthetic(name, seed=0)


@pytest.mark.parametrize(
    ("name", "size", "shortest", "longest"),
    [
        ("chat", 48, 256 + 768, 2016),
        ("multiturn", 24, 256, 600),
        ("unique", 24, 100, 300),
        ("pressure", 32, 300, 500),
        ("interleaved", 16, 32, 1024),
    ],
)
def test_a_synthetic_workload_has_its_documented_size_token_range_and_arrival_order(
    name, size, shortest, longest
):
    workload = synthetic(name)
    assert len(workload) == size
    assert len({r.id for r in workload}) == size
    for request in workload:
        assert request.prompt is None and request.prompt_token_ids is not None
        assert shortest <= len(request.prompt_token_ids) <= longest
        assert all(0 <= t <= 255 for t in request.prompt_token_ids)
    arrivals = [r.arrival_s for r in workload]
    assert arrivals == sorted(arrivals)
    assert describe(name)  # the docstring's first line, for help texts


@pytest.mark.parametrize("requests", [1, 5, 9])
@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_a_synthetic_workload_has_exactly_the_number_of_requests_asked_for(name, requests):
    assert len(synthetic(name, requests=requests)) == requests


def test_multiturn_turns_arrive_in_order_and_each_extends_the_previous_turns_prompt():
    workload = synthetic("multiturn")
    chats: dict[str, list[WorkloadRequest]] = {}
    for request in workload:
        chats.setdefault(request.id.split("-t")[0], []).append(request)
    assert len(chats) == 6
    for turns in chats.values():
        assert [r.id[-2:] for r in turns] == ["t0", "t1", "t2", "t3"]
        for before, after in itertools.pairwise(turns):
            assert before.prompt_token_ids is not None and after.prompt_token_ids is not None
            assert after.arrival_s > before.arrival_s
            assert after.prompt_token_ids[: len(before.prompt_token_ids)] == before.prompt_token_ids
            assert len(after.prompt_token_ids) >= len(before.prompt_token_ids) + 48


def test_multiturn_chats_share_the_256_token_system_prompt_and_nothing_longer():
    firsts = [r.prompt_token_ids for r in synthetic("multiturn") if r.id.endswith("-t0")]
    for a, b in itertools.combinations(firsts, 2):
        assert a is not None and b is not None
        assert 256 <= common_prefix(a, b) < 260


def by_session(workload: list[WorkloadRequest]) -> dict[str, list[WorkloadRequest]]:
    sessions: dict[str, list[WorkloadRequest]] = {}
    for request in workload:
        sessions.setdefault(request.session, []).append(request)
    return sessions


@pytest.mark.parametrize("seed", [0, 1])
def test_each_chat_round_extends_the_users_previous_prompt_and_fits_the_tiny_models_2048_positions(
    seed,
):
    workload = synthetic("chat", seed=seed)
    users = by_session(workload)
    assert len(users) == 12
    for session, turns in users.items():
        assert [r.id for r in turns] == [f"{session}-t{t}" for t in range(4)]
        for before, after in itertools.pairwise(turns):
            assert before.prompt_token_ids is not None and after.prompt_token_ids is not None
            assert after.arrival_s > before.arrival_s
            assert after.prompt_token_ids[: len(before.prompt_token_ids)] == before.prompt_token_ids
            assert len(after.prompt_token_ids) >= len(before.prompt_token_ids) + 96 + 32
        assert all(len(r.prompt_token_ids or ()) + r.params.max_tokens <= 2048 for r in turns)


def test_chat_users_take_turns_round_robin_so_every_other_user_comes_between_two_turns():
    workload = synthetic("chat")
    assert [r.id for r in workload[:13]] == [f"chat-u{u}-t0" for u in range(12)] + ["chat-u0-t1"]
    assert [r.arrival_s for r in workload] == [1.0 * i for i in range(48)]


def test_chat_users_share_the_system_prompt_and_nothing_longer():
    firsts = [r.prompt_token_ids for r in synthetic("chat") if r.id.endswith("-t0")]
    for a, b in itertools.combinations(firsts, 2):
        assert a is not None and b is not None
        assert common_prefix(a, b) == SYSTEM


def test_chat_histories_together_outgrow_the_default_device_and_host_pools():
    last = [r for r in synthetic("chat") if r.id.endswith("-t3")]
    blocks = sum((len(r.prompt_token_ids or ()) - SYSTEM) // 16 for r in last)
    assert blocks > 256 + 768


def test_a_chat_of_14_requests_has_4_users_and_drops_the_last_two_arrivals_of_round_4():
    ids = [r.id for r in synthetic("chat", requests=14)]
    assert ids == [f"chat-u{u}-t{t}" for t in range(4) for u in range(4)][:14]


def test_returning_turns_are_the_chat_rounds_after_the_first():
    workload = synthetic("chat", requests=30)
    assert returning_turns(workload) == {r.id for r in workload if not r.id.endswith("-t0")}
    multiturn = synthetic("multiturn")
    assert returning_turns(multiturn) == {r.id for r in multiturn if not r.id.endswith("-t0")}


def test_a_turn_that_does_not_extend_its_sessions_earlier_prompt_is_not_a_returning_turn():
    workload = parse_workload(
        [
            line(id="a", prompt_token_ids=[1, 2], session="s"),
            line(id="b", prompt_token_ids=[1, 2, 3], session="s", arrival_s=1),
            line(id="c", prompt_token_ids=[9, 9, 9, 9], session="s", arrival_s=2),
            line(id="d", prompt_token_ids=[1, 2, 3, 4], arrival_s=3),
            line(id="e", prompt="hi there", session="t"),
            line(id="f", prompt="hi there, again", session="t", arrival_s=1),
            line(id="g", prompt_token_ids=[1, 2, 3, 4, 5], session="u", arrival_s=4),
        ]
    )
    assert returning_turns(workload) == {"b", "f"}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_unique_prompts_share_no_prefix_at_all(seed):
    prompts = [r.prompt_token_ids for r in synthetic("unique", seed=seed, requests=200)]
    for a, b in itertools.combinations(prompts, 2):
        assert a is not None and b is not None
        assert common_prefix(a, b) == 0


def test_unique_prompts_beyond_256_requests_still_share_at_most_one_token():
    prompts = [r.prompt_token_ids for r in synthetic("unique", requests=300)]
    heads = {p[:2] for p in prompts if p is not None}
    assert len(heads) == 300


def test_pressure_arrives_at_once_and_needs_more_kv_than_a_512_block_device_pool():
    workload = synthetic("pressure")
    assert {r.arrival_s for r in workload} == {0.0}
    total = sum(len(r.prompt_token_ids or ()) + r.params.max_tokens for r in workload)
    assert total >= 32 * (300 + 32) > 512 * 16
    assert all(32 <= r.params.max_tokens <= 64 for r in workload)


def test_interleaved_streams_start_at_once_and_each_long_prompt_arrives_while_they_decode():
    workload = synthetic("interleaved")
    streams = [r for r in workload if r.id.startswith("stream-")]
    longs = [r for r in workload if r.id.startswith("long-")]
    assert len(streams) == 4 and len(longs) == 12
    assert {r.arrival_s for r in streams} == {0.0}
    assert all(32 <= len(r.prompt_token_ids or ()) <= 64 for r in streams)
    assert all(96 <= r.params.max_tokens <= 128 for r in streams)
    assert all(768 <= len(r.prompt_token_ids or ()) <= 1024 for r in longs)
    assert [r.arrival_s for r in longs] == [0.5 + 0.75 * i for i in range(12)]
    heads = {(r.prompt_token_ids or ())[:1] for r in workload}
    assert len(heads) == 16  # nothing shared
    assert [r.id for r in synthetic("interleaved", requests=3)] == ["stream-0", "long-1", "long-2"]


def test_an_unknown_synthetic_name_lists_the_known_ones():
    with pytest.raises(
        WorkloadError,
        match=r"^unknown synthetic workload 'multi'; "
        r"known: chat, multiturn, unique, pressure, interleaved$",
    ):
        synthetic("multi")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"seed": -1}, r"^seed must be an int >= 0, got -1$"),
        ({"seed": True}, r"^seed must be an int >= 0, got True$"),
        ({"requests": 0}, r"^requests must be an int >= 1, got 0$"),
    ],
)
def test_a_bad_synthetic_seed_or_size_is_a_workload_error(kwargs, message):
    with pytest.raises(WorkloadError, match=message):
        synthetic("unique", **kwargs)

"""Prefill/decode disaggregation end to end: real instances, a router, a shared tier.

One prefill, one decode and one ``both`` instance serve the whole module (``tests/pd.py``);
the router runs in the test's process over the first two. Every answer through the router
is compared with the ``both`` instance's answer to the same request (float64, greedy).
The faults come last, in order: each leaves the instances as the next test needs them,
and the last two kill an instance.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import httpx
import jsonschema
import orjson
import pytest
from engine_runs import replayed
from launching import wait_until
from openai.types.chat import ChatCompletionMessageParam
from pd import Pd, cached, completion, full_blocks, pd_instances, tokens
from routing import Rig, routed_urls
from structured_workloads import SCHEMA

from ringfence.actors.engine.intake import load_workload
from ringfence.actors.router.keys import keys_of
from ringfence.actors.text.tokenizer import ByteTokenizer
from ringfence.actors.tools.bench.serving.handover import read_handover

TTL_S = 3.0  # the decode instance's reservation_ttl_s
DEVICE_BLOCKS = 64  # the decode instance's pool: a flood of long prompts outgrows it


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pd]:
    with pd_instances(
        tmp_path_factory.mktemp("pd"),
        decode_sets=(
            f"cache.device_blocks={DEVICE_BLOCKS}",
            f"engine.reservation_ttl_s={TTL_S}",
            "events.enabled=true",
        ),
        prefill_sets=("events.enabled=true",),  # the router's cache policy follows both
    ) as instances:
        yield instances


@pytest.fixture(scope="module")
def rig(pd: Pd) -> Iterator[Rig]:
    prefill, decode = pd.urls()
    # The prefill's deadline past the reservation's life: a late prefill costs a reservation.
    with routed_urls(prefill, decode, prefill_timeout_s=20.0, reserve_timeout_s=120.0) as rig:
        yield rig


def prompts(workload: str, count: int) -> list[tuple[int, ...]]:
    return [tuple(line.prompt_token_ids or ()) for line in load_workload(workload, requests=count)]


def fresh_prompt(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(3, 250) for _ in range(length))


def both_and_routed(pd: Pd, rig: Rig, prompt: tuple[int, ...], max_tokens: int) -> dict[str, Any]:
    """The router's answer, checked against the ``both`` instance's tokens."""
    expected = tokens(completion(pd.both.url, prompt, max_tokens))
    answer = completion(rig.url, prompt, max_tokens)
    assert tokens(answer) == expected
    return answer


def test_unique_prompts_through_the_router_equal_a_both_instance_and_come_from_the_tier(
    pd: Pd, rig: Rig
):
    batch = prompts("synthetic:unique", 6)
    with ThreadPoolExecutor(len(batch)) as pool:
        answers = list(pool.map(lambda p: both_and_routed(pd, rig, p, 12), batch))
    for prompt, answer in zip(batch, answers, strict=True):
        assert cached(answer)["storage"] == full_blocks(prompt), cached(answer)
    assert rig.metric("ringfence_router_prefills_total") >= len(batch)


def test_a_structured_output_through_the_router_equals_the_both_instance_and_is_valid(
    pd: Pd, rig: Rig
):
    # The decode instance samples every output token itself, the first included, from the
    # prompt's KV the prefill instance stored: its matcher starts at the output's start
    # there, as on the both instance (issue 38).
    prompt = fresh_prompt(38, 3 * 16 + 5)
    ask = {"structured_outputs": {"json": SCHEMA}, "temperature": 1.0, "seed": 38}
    expected = tokens(completion(pd.both.url, prompt, 96, **ask))
    answer = completion(rig.url, prompt, 96, **ask)
    assert tokens(answer) == expected
    assert cached(answer)["storage"] == full_blocks(prompt), cached(answer)
    assert answer["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(answer["choices"][0]["text"]), SCHEMA)


def test_a_salted_prompt_is_handed_over_under_its_salt_and_another_salt_finds_nothing(
    pd: Pd, rig: Rig
):
    prompt = fresh_prompt(7, 4 * 16 + 3)
    expected = tokens(completion(pd.both.url, prompt, 6))
    first = completion(rig.url, prompt, 6, cache_salt="tenant-x")
    # The prefill keyed the blocks as the decode side does: they came from the tier.
    assert tokens(first) == expected
    assert cached(first)["storage"] == full_blocks(prompt), cached(first)
    # The same prompt under another salt (straight to the decode side's tier) finds none.
    other = completion(pd.both.url, prompt, 6, cache_salt="tenant-y")
    assert tokens(other) == expected and sum(cached(other).values()) == 0, cached(other)


def test_the_hand_over_is_timed_per_block_from_the_instances_logs_and_the_routers(pd: Pd, rig: Rig):
    prompt = fresh_prompt(3, 5 * 16 + 4)  # five full blocks to hand over
    both_and_routed(pd, rig, prompt, 4)
    found = read_handover(
        pd.prefill.launch.run_dir, pd.decode.launch.run_dir, rig.log.events("router.answered")
    )
    write, visible, prefetched = found["write"], found["visible"], found["prefetched"]
    assert write["ops"] >= 1 and write["blocks"] >= 5 and write["us_per_block"] > 0
    assert visible["requests"] >= 1 and visible["blocks"] >= 5 and visible["ms_per_block"] > 0
    assert prefetched["blocks"] >= 5 and prefetched["us_per_block"] > 0
    assert found["router"]["outcomes"].get("ok", 0) >= 1
    assert found["router"]["prefill_s"]["p50"] > 0 and found["router"]["stored_blocks"] >= 5


def test_multi_turn_chats_through_the_router_equal_a_both_instance(pd: Pd, rig: Rig):
    for prompt in prompts("synthetic:multiturn", 6):  # each turn extends an earlier one
        answer = both_and_routed(pd, rig, prompt, 10)
        # Every full block came from a cache: the tier, or the decode side's own device.
        assert sum(cached(answer).values()) == full_blocks(prompt), cached(answer)


def test_a_streamed_chat_through_the_router_equals_the_both_instance(pd: Pd, rig: Rig):
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Tell me about shared memory rings. " * 12}
    ]
    expected = pd.both.client().chat.completions.create(
        model="ringfence-tiny", messages=messages, max_tokens=12, temperature=0
    )
    stream = rig.openai().chat.completions.create(
        model="ringfence-tiny", messages=messages, max_tokens=12, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )  # fmt: skip
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == expected.choices[0].message.content
    assert usage is not None and usage.prompt_tokens_details is not None
    cached_tokens = usage.prompt_tokens_details.cached_tokens or 0
    assert cached_tokens >= full_blocks(range(usage.prompt_tokens))


def sse_chunks(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed answer's chunks (it must end in [DONE])."""
    with httpx.Client(base_url=url, timeout=120.0, trust_env=False) as client:
        answer = client.post(path, json={**body, "stream": True})
    assert answer.status_code == 200, answer.text
    events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    return [orjson.loads(event) for event in events[:-1]]


def prompt_tokens_counted(url: str) -> float:
    with httpx.Client(base_url=url, timeout=30.0, trust_env=False) as client:
        text = client.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith("ringfence_prompt_tokens_total "))
    return float(line.split()[1])


def same_logprobs(a: list[float | None], b: list[float | None]) -> bool:
    """float64 log probabilities of a prompt computed in other chunks: equal to 1e-9."""
    return len(a) == len(b) and all(
        x == y if x is None or y is None else math.isclose(x, y, abs_tol=1e-9)
        for x, y in zip(a, b, strict=True)
    )


def test_n_2_seeded_choices_with_logprobs_through_the_router_equal_the_both_instances(
    pd: Pd, rig: Rig
):
    prompt = fresh_prompt(49, 3 * 16 + 7)
    ask = {"n": 2, "temperature": 1.0, "seed": 49, "logprobs": 2}
    counted = prompt_tokens_counted(pd.decode.url)
    ok = rig.metric("ringfence_router_requests_total", outcome="ok")
    expected = completion(pd.both.url, prompt, 8, **ask)
    answer = completion(rig.url, prompt, 8, **ask)
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for mine, theirs in zip(answer["choices"], expected["choices"], strict=True):
        assert mine["token_ids"] == theirs["token_ids"] and mine["text"] == theirs["text"]
        assert mine["logprobs"]["tokens"] == theirs["logprobs"]["tokens"]
        assert same_logprobs(
            mine["logprobs"]["token_logprobs"], theirs["logprobs"]["token_logprobs"]
        )
    assert answer["choices"][0]["token_ids"] != answer["choices"][1]["token_ids"]
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(prompt), 16)
    # One request: the prompt counted once on the decode instance, the request once here.
    assert prompt_tokens_counted(pd.decode.url) - counted == len(prompt)
    assert rig.metric("ringfence_router_requests_total", outcome="ok") - ok == 1
    body = {"prompt": list(prompt), "max_tokens": 8, **ask,
            "stream_options": {"include_usage": True}}  # fmt: skip
    chunks = sse_chunks(rig.url, "/v1/completions", body)
    assert len({c["id"] for c in chunks}) == 1
    for index, theirs in enumerate(expected["choices"]):
        mine = [
            c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index
        ]
        assert "".join(c["text"] for c in mine) == theirs["text"]
    assert [c["usage"]["completion_tokens"] for c in chunks if not c["choices"]] == [16]


def test_n_2_chat_choices_with_top_logprobs_through_the_router_equal_the_both_instances(
    pd: Pd, rig: Rig
):
    body = {"messages": [{"role": "user", "content": "Two answers, please. " * 4}],
            "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 7, "logprobs": True,
            "top_logprobs": 3}  # fmt: skip
    expected = pd.both.post("/v1/chat/completions", body).json()
    answer = rig.post("/v1/chat/completions", body)
    assert answer.status_code == 200, answer.text
    choices = answer.json()["choices"]
    assert [c["message"] for c in choices] == [c["message"] for c in expected["choices"]]
    for mine, theirs in zip(choices, expected["choices"], strict=True):
        got, want = mine["logprobs"]["content"], theirs["logprobs"]["content"]
        assert [t["token"] for t in got] == [t["token"] for t in want]
        assert [[a["token"] for a in t["top_logprobs"]] for t in got] == [
            [a["token"] for a in t["top_logprobs"]] for t in want
        ]
    chunks = sse_chunks(rig.url, "/v1/chat/completions", body)
    for index, theirs in enumerate(expected["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"]["role"] == "assistant"
        assert (
            "".join(c["delta"].get("content") or "" for c in mine) == theirs["message"]["content"]
        )


def test_a_stop_strings_tokens_are_cut_from_the_logprobs_through_the_router(pd: Pd, rig: Rig):
    prompt = fresh_prompt(50, 2 * 16 + 3)
    free = completion(pd.both.url, prompt, 16, logprobs=1)["choices"][0]
    stop = next(ch for k, ch in enumerate(free["text"])
                if k and ch != "\ufffd" and free["text"].find(ch) == k)  # fmt: skip
    text = free["text"][: free["text"].find(stop)]
    for url in (pd.both.url, rig.url):  # the instance itself, and through the router
        cut = completion(url, prompt, 16, logprobs=1, stop=[stop])["choices"][0]
        assert cut["text"] == text and cut["finish_reason"] == "stop"
        kept = cut["logprobs"]["token_logprobs"]
        assert ByteTokenizer().decode(free["token_ids"][: len(kept)]) == text, url
        assert same_logprobs(kept, free["logprobs"]["token_logprobs"][: len(kept)])


def test_a_prompt_the_decode_instance_holds_already_is_not_prefilled_again(pd: Pd, rig: Rig):
    prompt = fresh_prompt(400, 70)
    first = both_and_routed(pd, rig, prompt, 4)
    assert rig.log.events("router.answered")[-1]["prefill"] == pd.prefill.url
    keys = keys_of(rig.router.pool.of_role("decode")[0].identity, prompt)
    index = rig.router.index
    assert index is not None and len(keys) == 4

    def held() -> bool:
        found = index.overlap(keys).get(pd.decode.url)
        return found is not None and found.blocks == len(keys)

    wait_until("the decode instance's events to reach the router", held, 30.0)
    second = both_and_routed(pd, rig, prompt, 4)
    answered = rig.log.events("router.answered")[-1]
    assert answered["prefill_skipped"] is True and answered["prefill"] is None, answered
    assert answered["prompt_blocks"] == 4 and answered["decode_cached"] > 0
    assert tokens(second) == tokens(first)
    assert sum(cached(second).values()) >= full_blocks(prompt)


def test_a_flood_of_long_prompts_waits_for_room_and_never_preempts_a_running_decode(
    pd: Pd, rig: Rig
):
    long_decode = fresh_prompt(1, 40)
    retries = rig.metric("ringfence_router_reserve_retries_total")
    running: dict[str, Any] = {}

    def decode_long() -> None:
        running["answer"] = both_and_routed(pd, rig, long_decode, 160)

    first = threading.Thread(target=decode_long)
    first.start()
    wait_until(
        "the long decode to run",
        lambda: bool(pd.decode.engine_events("reservation.claim")),
        60.0,
    )
    flood = [fresh_prompt(100 + i, 560) for i in range(5)]  # 36 blocks each, beside 13
    with ThreadPoolExecutor(len(flood)) as pool:
        list(pool.map(lambda p: both_and_routed(pd, rig, p, 8), flood))
    first.join(120.0)
    assert "answer" in running
    assert rig.metric("ringfence_router_reserve_retries_total") > retries  # backpressure
    refused = pd.decode.engine_events("reservation.refuse", retry=True)
    assert refused and "kept for running requests' growth" in refused[0]["error"]
    decisions = [d for e in pd.decode.engine_events("sched.schedule") for d in e["decisions"]]
    assert not [d for d in decisions if d[0] == "preempt"], "a running decode was preempted"


def test_a_corrupt_stored_block_is_a_miss_computed_again(pd: Pd, rig: Rig):
    prompt = fresh_prompt(7, 100)
    with httpx.Client(base_url=pd.prefill.url, timeout=60.0, trust_env=False) as client:
        before = set(pd.tier.rglob("*"))
        body = {"prompt_token_ids": list(prompt), "request_id": "corrupt"}
        answer = client.post("/ringfence/prefill", json=body).json()
    assert answer["stored_blocks"] == len(prompt) // 16
    written = sorted(p for p in set(pd.tier.rglob("*")) - before if p.is_file())
    assert written
    for path in written:  # same length, other bytes: only the checksum can tell
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    routed = both_and_routed(pd, rig, prompt, 8)  # the prefill side skips what it stored
    assert cached(routed)["storage"] < full_blocks(prompt)
    assert pd.decode.launch.events("storage.corrupt", log="store-0")


def test_a_prefill_delayed_past_the_reservation_costs_a_second_reservation(pd: Pd, rig: Rig):
    expired = rig.metric("ringfence_router_reservations_expired_total")
    store = pd.prefill.launch.actor("store-0")["pid"]
    prompt = fresh_prompt(11, 90)
    assert store in {s.pid for s in pd.prefill.launch.child_stamps()}
    holder = threading.Timer(TTL_S + 1.5, lambda: _signal(store, signal.SIGCONT))
    _signal(store, signal.SIGSTOP)  # its writes wait: the prefill answers late
    holder.start()
    try:
        answer = both_and_routed(pd, rig, prompt, 8)
    finally:
        holder.join()
        _signal(store, signal.SIGCONT)
    assert rig.metric("ringfence_router_reservations_expired_total") == expired + 1
    assert pd.decode.engine_events("reservation.expire")
    assert cached(answer)["storage"] == full_blocks(prompt)  # the late prefill was whole


def test_replay_passes_on_the_prefill_and_decode_instances_run_dirs(pd: Pd):
    for server in (pd.prefill, pd.decode):
        wait_until("the instance to be idle", partial(_idle, server), 30.0)
        replayed(server.launch.run_dir)


def test_the_prefill_instance_killed_mid_run_costs_recomputation_not_tokens(pd: Pd, rig: Rig):
    # 150 tokens a prompt: the prefill instance prefills three a step (512 tokens), so the
    # kill after the first hand-over lands with most of the batch still to prefill.
    batch = [fresh_prompt(200 + i, 150) for i in range(12)]
    fallbacks = _fallbacks(rig)
    with ThreadPoolExecutor(len(batch) + 1) as pool:
        expected = list(pool.map(lambda p: tokens(completion(pd.both.url, p, 10)), batch))
        answers = [pool.submit(completion, rig.url, p, 10) for p in batch]
        holds = len(pd.prefill.engine_events("handover.hold"))
        wait_until(  # some prefills ran: the kill lands mid-run
            "a prefill", lambda: len(pd.prefill.engine_events("handover.hold")) > holds, 60.0
        )
        for stamp in [*pd.prefill.launch.child_stamps()]:
            _signal(stamp.pid, signal.SIGKILL)
        pd.prefill.launch.send_signal(signal.SIGKILL)
        held = len(pd.prefill.engine_events("handover.hold")) - holds
        results = [a.result(120.0) for a in answers]
    assert [tokens(r) for r in results] == expected
    if held < len(batch):  # the prompts it had not handed over were computed again
        assert _fallbacks(rig) > fallbacks, held


def test_the_decode_instance_killed_ends_the_stream_with_an_error_at_the_router(pd: Pd, rig: Rig):
    body = {"prompt": list(fresh_prompt(300, 60)), "max_tokens": 400, "temperature": 0.0,
            "stream": True}  # fmt: skip
    events: list[str] = []
    with (
        httpx.Client(base_url=rig.url, timeout=60.0, trust_env=False) as client,
        client.stream("POST", "/v1/completions", json=body) as answer,
    ):
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data:"):
                continue
            events.append(line)
            if len(events) == 3:
                for stamp in pd.decode.launch.child_stamps():
                    _signal(stamp.pid, signal.SIGKILL)
                pd.decode.launch.send_signal(signal.SIGKILL)
    assert events[-1] == "data: [DONE]"
    error = orjson.loads(events[-2].removeprefix("data: "))
    assert "error" in error and error["error"]["code"] == "decode_failed", error


def _signal(pid: int, signum: int) -> None:
    os.kill(pid, signum)


def _idle(server: Any) -> bool:
    load = server.get("/ringfence/instance").json()["load"]
    return bool(load.get("running", 1) == 0 and load.get("waiting", 1) == 0)


def _fallbacks(rig: Rig) -> float:
    text = rig.http().get("/metrics").text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("ringfence_router_prefill_fallbacks_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total

"""``ringfence router --instance`` over two real ``ringfence serve`` instances (the tiny
preset, publishing KV events): the ``cache`` policy sends a prompt to the instance its
events say holds the prefix; ``round_robin`` takes turns; a request's greedy tokens are
the same whatever the policy; an instance that cannot be reached is routed around."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import httpx
import pytest
from launching import wait_until
from routing import routed_urls
from serving import Server, served, started

from ringfence.actors.router.forward import INSTANCE_HEADER
from ringfence.actors.router.policy import Picker
from ringfence.cache.block_hash import block_keys
from ringfence.cache.ids import BlockHash
from ringfence.cache.kv_index import KVIndex

SETS = ("model.preset=tiny", "sched.max_model_len=256", "events.enabled=true")
EVENTS_S = 30.0  # how long a prompt's blocks may take to reach the router's index


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Iterator[list[Server]]:
    with contextlib.ExitStack() as stack:
        servers: list[Any] = [served(tmp_path_factory.mktemp(f"i{n}"), *SETS) for n in range(2)]
        yield started(stack, servers)


def prompt(seed: int, blocks: int = 4, size: int = 16) -> list[int]:
    return [(seed * 31 + 7 * i) % 250 + 1 for i in range(blocks * size + 3)]


def picker_of(rig) -> Picker:
    picker = rig.router.picker
    assert picker is not None
    return picker


def index_of(rig) -> KVIndex:
    index = picker_of(rig).index
    assert index is not None
    return index


def holds(index: KVIndex, keys: list[BlockHash], url: str) -> bool:
    found = index.overlap(keys).get(url)
    return found is not None and found.blocks == len(keys)


def complete(rig, tokens: list[int]) -> tuple[str, list[int]]:
    body = {"prompt": tokens, "max_tokens": 4, "temperature": 0}
    answer = rig.post("/v1/completions", body)
    assert answer.status_code == 200, answer.text
    return answer.headers[INSTANCE_HEADER], answer.json()["choices"][0]["text"]


def test_cache_sends_a_prompt_where_its_prefix_is_cached(pair):
    a, b = pair
    with routed_urls([], [], instances=(a.url, b.url), policy="cache") as rig:
        card = b.get("/v1/models").json()["data"][0]["ringfence"]
        for seed, warm in ((1, b), (2, a)):
            tokens = prompt(seed)
            keys = block_keys(
                tokens, card["block_size"], namespace=bytes.fromhex(card["fingerprint"])
            )
            direct = warm.post("/v1/completions", {"prompt": tokens, "max_tokens": 1})
            assert direct.status_code == 200, direct.text
            wait_until(
                f"the router's index to hold the prompt's blocks on {warm.url}",
                partial(holds, index_of(rig), keys, warm.url),
                EVENTS_S,
            )
            for _ in range(3):
                assert complete(rig, tokens)[0] == warm.url
        routed = rig.log.events("router.routed")
        assert [r["cached_blocks"] for r in routed] == [4.0] * 6
        assert all(r["policy"] == "cache" and r["outcome"] == "ok" for r in routed)


def test_a_salted_prompt_is_published_and_routed_under_its_salt_only(pair):
    a, b = pair
    tokens = prompt(5)
    card = b.get("/v1/models").json()["data"][0]["ringfence"]
    namespace = bytes.fromhex(card["fingerprint"])
    salted = block_keys(tokens, card["block_size"], namespace=namespace, salt="tenant-s")
    with routed_urls([], [], instances=(a.url, b.url), policy="cache") as rig:
        body = {"prompt": tokens, "max_tokens": 1, "cache_salt": "tenant-s"}
        assert b.post("/v1/completions", body).status_code == 200
        wait_until(
            f"the router's index to hold the salted blocks on {b.url}",
            partial(holds, index_of(rig), salted, b.url),
            EVENTS_S,
        )
        plain = block_keys(tokens, card["block_size"], namespace=namespace)
        found = index_of(rig).overlap(plain)  # the KV events carry the salted keys only
        assert not [o for o in found.values() if o.blocks], found
        for salt in ("tenant-s", "tenant-t", None):
            answer = rig.post("/v1/completions", {**body, "cache_salt": salt, "max_tokens": 4})
            assert answer.status_code == 200, answer.text
        routed = rig.log.events("router.routed")
        assert [r["cached_blocks"] for r in routed] == [4.0, 0.0, 0.0]
        assert routed[0]["instance"] == b.url


def test_round_robin_takes_turns_and_every_policy_gives_the_same_greedy_tokens(pair):
    a, b = pair
    answers = {}
    for policy in ("round_robin", "least_loaded", "approximate", "cache"):
        with routed_urls([], [], instances=(a.url, b.url), policy=policy) as rig:
            served_by = [complete(rig, prompt(seed))[0] for seed in range(10, 14)]
            answers[policy] = [complete(rig, prompt(20 + n))[1] for n in range(3)]
        if policy == "round_robin":
            assert served_by == [a.url, b.url, a.url, b.url]
    assert len({tuple(texts) for texts in answers.values()}) == 1, answers


def test_an_instance_that_cannot_be_reached_is_routed_around(pair):
    a, b = pair
    with routed_urls([], [], instances=(a.url, b.url), policy="round_robin") as rig:
        (first, second) = rig.router.pool.of_role("both")
        first.url = "http://127.0.0.1:9"  # nothing listens there: the next one serves
        assert complete(rig, prompt(30))[0] == second.url
        assert picker_of(rig).down == {"http://127.0.0.1:9"}
        assert complete(rig, prompt(31))[0] == second.url


def keys_of(server: Server, tokens: list[int]) -> list[BlockHash]:
    card = server.get("/v1/models").json()["data"][0]["ringfence"]
    return block_keys(tokens, card["block_size"], namespace=bytes.fromhex(card["fingerprint"]))


def test_a_router_restart_rebuilds_its_index_from_the_instances_replay(pair):
    a, b = pair
    tokens = prompt(40)
    keys = keys_of(b, tokens)
    direct = b.post("/v1/completions", {"prompt": tokens, "max_tokens": 1})
    assert direct.status_code == 200, direct.text
    # Two routers one after the other, both started after the blocks were published: each
    # index holds them only through the replay socket.
    for _ in range(2):
        with routed_urls([], [], instances=(a.url, b.url), policy="cache") as rig:
            wait_until(
                "the new router's index to hold the prompt's blocks on the instance",
                partial(holds, index_of(rig), keys, b.url),
                EVENTS_S,
            )
            assert complete(rig, tokens)[0] == b.url
            followers = list(rig.router.followers.values())
            assert sum(f.counts.replayed for f in followers) > 0


def test_each_instance_reports_its_load_and_the_router_follows_it(pair):
    a, b = pair
    first = a.get("/ringfence/load").json()  # after=0: at once
    assert first["seq"] >= 1 and 0 < first["free_blocks"] <= first["total_blocks"], first
    body = {"max_tokens": 150, "temperature": 0, "ignore_eos": True}  # within 256 tokens
    with (
        routed_urls([], [], instances=(a.url, b.url), policy="least_loaded") as rig,
        ThreadPoolExecutor(5) as pool,
    ):
        poll = pool.submit(a.get, f"/ringfence/load?after={first['seq']}&wait_s=30")
        runs = [pool.submit(a.post, "/v1/completions", {"prompt": prompt(60 + n), **body})
                for n in range(4)]  # fmt: skip
        changed = poll.result(60).json()
        assert changed["seq"] > first["seq"] and changed["running"] + changed["waiting"] > 0

        # The router heard it too: requests it did not send count on that instance.
        (first_instance, _) = rig.router.pool.of_role("both")

        def busy() -> bool:
            load = first_instance.load
            return load is not None and load.running + load.waiting > 0

        wait_until("the router to hear the instance's load", busy, 30.0)
        assert complete(rig, prompt(70))[0] == b.url
        for run in runs:
            assert run.result(60).status_code == 200


def test_a_worker_restart_clears_what_the_router_index_held_of_its_device(pair):
    a, b = pair
    tokens = prompt(80)
    keys = keys_of(a, tokens)
    with routed_urls([], [], instances=(a.url, b.url), policy="cache") as rig:
        assert a.post("/v1/completions", {"prompt": tokens, "max_tokens": 1}).status_code == 200
        index = index_of(rig)

        def on_device() -> int:
            found = index.overlap(keys).get(a.url)
            return 0 if found is None else found.on.get("GPU", 0)

        wait_until("the index to hold the prompt on the device", lambda: on_device() == 4, EVENTS_S)
        a.launch.kill_actor("worker-0")
        wait_until("AllBlocksCleared(GPU) from the instance", lambda: on_device() == 0, 60.0)
        a.wait_health(200)
        assert complete(rig, tokens)[0] in (a.url, b.url)  # served again, from wherever


def test_a_killed_instance_is_routed_around_with_no_failed_request_and_back_once_restarted(
    pair, tmp_path
):
    a, b = pair
    batch = [prompt(100 + n) for n in range(8)]
    body = {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
    expected = [b.post("/v1/completions", {"prompt": p, **body}).json()["choices"][0]["text"]
                for p in batch]  # fmt: skip
    with (
        routed_urls([], [], instances=(a.url, b.url), policy="round_robin") as rig,
        ThreadPoolExecutor(len(batch)) as pool,
    ):
        answers = [pool.submit(rig.post, "/v1/completions", {"prompt": p, **body}) for p in batch]
        wait_until("requests running on the instance", lambda: _running(a), 30.0)
        for stamp in a.launch.child_stamps():
            os.kill(stamp.pid, signal.SIGKILL)
        a.launch.send_signal(signal.SIGKILL)
        results = [answer.result(120.0) for answer in answers]
        assert [r.status_code for r in results] == [200] * len(batch), [r.text for r in results]
        assert [r.json()["choices"][0]["text"] for r in results] == expected
        assert {r.headers[INSTANCE_HEADER] for r in results[-4:]} == {b.url}
        assert picker_of(rig).down == {a.url}
        assert rig.log.events("router.instance_down")

        # The same address again, a new instance: once it serves, it is routed to again.
        port = int(a.url.rsplit(":", 1)[1])
        with served(tmp_path, *SETS, port=port) as again:
            up = lambda: bool(rig.log.events("router.instance_up"))  # noqa: E731
            wait_until("router.instance_up", up, 60.0)
            assert picker_of(rig).down == set()
            served_by = {complete(rig, prompt(120 + n))[0] for n in range(2)}
            assert served_by == {again.url, b.url}


def _running(server: Server) -> bool:
    try:
        load = server.get("/ringfence/load").json()
    except httpx.TransportError:
        return False
    return bool(load["running"] > 0)

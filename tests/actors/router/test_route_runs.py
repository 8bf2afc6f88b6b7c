"""``ringfence router --instance`` over two real ``ringfence serve`` instances (the tiny
preset, publishing KV events): the ``cache`` policy sends a prompt to the instance its
events say holds the prefix; ``round_robin`` takes turns; a request's greedy tokens are
the same whatever the policy; an instance that cannot be reached is routed around."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

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
    return index.overlap(keys)[url].blocks == len(keys)


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

"""The ``cache`` policy against ``round_robin`` on ``bench route``'s three cases, replayed
in virtual time over simulated engines (``tests/sim_replay.py``): the same figures on every
run, so issue 49's targets near saturation are checked exactly, not through a noisy bench."""

from __future__ import annotations

import pytest
from sim_replay import replay

from ringfence.actors.tools.bench.serving import route

SEEDS = (0, 1, 2)  # the workload's arrival times and tokens


@pytest.mark.parametrize("seed", SEEDS)
def test_at_light_load_each_system_prompt_is_computed_once_then_each_turns_new_blocks(seed):
    case = route.CASES["light"]
    groups, users, turns = int(case["groups"]), int(case["users"]), int(case["turns"])
    system = int(case["system_blocks"]) * route.BLOCK
    # The least any policy computes: a group's first prompt whole (system prompt, message);
    # the group's other first turns, their message; a later turn, the last answer and the
    # new message (every prompt ends on a full block, its new message: computed anyway).
    least = groups * (system + route.BLOCK) + groups * (users - 1) * route.BLOCK
    least += groups * users * (turns - 1) * 2 * route.BLOCK
    cache, rr = replay("light", "cache", seed=seed), replay("light", "round_robin", seed=seed)
    assert cache.computed_tokens == least < rr.computed_tokens
    assert cache.ttft_p90_s < rr.ttft_p90_s


@pytest.mark.parametrize("seed", SEEDS)
def test_near_saturation_the_cache_policy_computes_less_and_answers_sooner(seed):
    cache = replay("saturation", "cache", seed=seed)
    rr = replay("saturation", "round_robin", seed=seed)
    assert cache.computed_tokens < rr.computed_tokens
    assert cache.ttft_p90_s < rr.ttft_p90_s
    assert sum(cache.per_instance) == sum(rr.per_instance) == 54


@pytest.mark.parametrize("seed", SEEDS)
def test_a_hot_prefix_flood_is_spread_over_every_instance_no_slower_than_round_robin(seed):
    cache, rr = replay("flood", "cache", seed=seed), replay("flood", "round_robin", seed=seed)
    # One instance cannot keep up: each computes the prefix once, then shares the flood.
    assert max(cache.per_instance) - min(cache.per_instance) <= 1
    assert cache.ttft_p90_s <= rr.ttft_p90_s
    assert cache.computed_tokens < rr.computed_tokens  # each user's next turn where its last was

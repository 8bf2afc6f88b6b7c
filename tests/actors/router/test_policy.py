"""The router's policies and their cost function (``actors/router/policy.py``) on instances
and an index made by hand: where a prompt goes, and how far a hot prefix draws a flood."""

from __future__ import annotations

from hashlib import blake2b

import pytest

from ringfence.actors.http.load import Load
from ringfence.actors.router.cli import OVERLAP_WEIGHT, POLICY_CHOICES
from ringfence.actors.router.instances import Identity, Instance
from ringfence.actors.router.options import RouterOptions
from ringfence.actors.router.policy import (
    DEFAULT_OVERLAP_WEIGHT,
    POLICIES,
    Choice,
    Picker,
    Weights,
)
from ringfence.cache.ids import BlockHash
from ringfence.cache.kv_events import AllBlocksCleared, BlockStored
from ringfence.cache.kv_index import KVIndex

IDENT = Identity(role="both", model="m", fingerprints=("ab",), namespace="00", block_size=16)


def instances(n: int = 3) -> list[Instance]:
    return [Instance(f"http://i{k}", "both", IDENT) for k in range(n)]


def keys(seed: int, n: int) -> list[BlockHash]:
    return [BlockHash(blake2b(f"{seed}:{k}".encode(), digest_size=16).digest()) for k in range(n)]


def store(index: KVIndex, url: str, ks: list[BlockHash], medium: str = "GPU") -> None:
    index.apply(
        url, BlockStored(keys=tuple(ks), parent=None, token_ids=(), block_size=16, medium=medium)
    )


def send(picker: Picker, ks: list[BlockHash]) -> Instance:
    """Choose for ``ks`` and count it in flight there (as the router does until it ends)."""
    choice = picker.choose(ks)
    assert choice is not None
    picker.sent(choice, ks)
    picker.routed(choice, ks)
    choice.instance.in_flight += 1
    return choice.instance


def test_a_prefix_held_by_one_instance_only_draws_its_prompts_there():
    a, b, c = instances()
    index = KVIndex()
    picker = Picker("cache", [a, b, c], index)
    store(index, b.url, keys(1, 8))
    store(index, c.url, keys(2, 8))
    for _ in range(3):
        choice = picker.choose(keys(1, 10))
        assert choice is not None and choice.instance is b and choice.cached == 8.0
        assert picker.choose(keys(2, 8)).instance is c  # type: ignore[union-attr]


def test_a_prompt_in_flight_counts_as_held_where_it_went_before_any_event_says_so():
    a, b, c = instances()
    picker = Picker("cache", [a, b, c], KVIndex())  # no event has come yet
    first = keys(1, 8) + keys(2, 2)
    assert send(picker, first) is a
    # A next turn, or another user behind the same prefix: held on a, 8 of its 10 blocks,
    # while the first is in flight there (an unknown prompt would go to b, the least loaded).
    choice = picker.choose(keys(1, 8) + keys(3, 2))
    assert choice is not None and (choice.instance, choice.cached) == (a, 8.0)
    assert picker.choose(keys(9, 10)).instance is b  # type: ignore[union-attr]


def test_a_prompt_no_longer_counts_as_held_once_its_request_ended_or_its_instance_is_down():
    a, b = instances(2)
    index = KVIndex()
    picker = Picker("cache", [a, b], index)
    prompt = keys(1, 10)
    for _ in range(2):  # two requests of it in flight on a: it counts until both ended
        choice = picker.choose(prompt)
        assert choice is not None and choice.instance is a
        picker.sent(choice, prompt)
    picker.ended(Choice(a, 0.0, 10), prompt)
    assert picker.choose(prompt).cached == 10.0  # type: ignore[union-attr]
    picker.ended(Choice(a, 0.0, 10), prompt)
    assert picker.choose(prompt).cached == 0.0  # type: ignore[union-attr]
    store(index, a.url, prompt[:4])  # what a's events say stays
    picker.sent(Choice(a, 4.0, 10), prompt)
    assert picker.flying(a, prompt) == 10
    picker.mark_down(a)
    picker.mark_up(a)
    assert picker.flying(a, prompt) == 0
    picker.ended(Choice(a, 4.0, 10), prompt)  # the request that was there ends: no error
    assert picker.flying(a, prompt) == 0


def test_only_the_cache_policy_counts_prompts_in_flight():
    a, b = instances(2)
    picker = Picker("least_loaded", [a, b], None)
    send(picker, keys(1, 10))
    assert picker.flying(a, keys(1, 10)) == 0 == picker.flying(b, keys(1, 10))


def test_the_medium_weighs_a_cached_prefix():
    a, b = instances(2)
    index = KVIndex()
    picker = Picker("cache", [a, b], index, Weights(host=0.8, storage=0.5))
    store(index, a.url, keys(1, 10), medium="STORAGE")
    store(index, b.url, keys(1, 6), medium="GPU")  # shorter, but on the device: 6 > 5
    choice = picker.choose(keys(1, 10))
    assert choice is not None and (choice.instance, choice.cached) == (b, 6.0)
    store(index, a.url, keys(1, 10), medium="CPU")  # now 8 on the host beats 6
    choice = picker.choose(keys(1, 10))
    assert choice is not None and (choice.instance, choice.cached) == (a, 8.0)


@pytest.mark.parametrize("overlap", [1.0, 2.0])
def test_a_flood_on_a_hot_prefix_piles_on_its_holder_only_as_far_as_the_load_term_allows(
    overlap: float,
):
    a, b, c = instances()
    index = KVIndex()
    picker = Picker("cache", [a, b, c], index, Weights(overlap=overlap))
    hot = keys(7, 8)
    store(index, a.url, hot)
    served = [send(picker, hot) for _ in range(30)]  # none finishes nor begins: the worst
    # Each goes where overlap * need + in_flight * mean_need is least: the holder while its
    # queue costs no more than recomputing the prefix (8 blocks) elsewhere (ties go to the
    # most cached), so its queue runs ahead of the others' by overlap * 8 / mean_need + 1 at
    # most; an instance it then goes to holds the prefix too (in flight there), and fills
    # as far. Every one needed nothing where it went: each counts as 1 block.
    assert picker.mean_need() == 1.0
    others = max(served.count(b), served.count(c))
    assert served.count(a) <= others + overlap * 8 + 1
    order = "".join("abc"[[a, b, c].index(i)] for i in served)
    assert order == {1.0: "a" * 9 + "b" * 9 + "c" * 9 + "abc", 2.0: "a" * 17 + "b" * 13}[overlap]


def queue(picker: Picker, ks: list[BlockHash]) -> Choice:
    """Choose for ``ks`` and count it in flight and not begun there (before its first byte,
    as the router counts it)."""
    choice = picker.choose(ks)
    assert choice is not None
    picker.sent(choice, ks)
    picker.routed(choice, ks)
    choice.instance.in_flight += 1
    choice.instance.unstarted += 1
    choice.instance.ahead_blocks += choice.need
    return choice


def hot_prompt(n: int) -> list[BlockHash]:
    """The ``n``-th prompt of a flood: the hot 8-block prefix, then 2 blocks of its own."""
    return keys(7, 8) + keys(100 + n, 2)


def test_a_hot_prefix_spills_once_the_prefill_queued_on_its_holder_costs_more_than_its_hit():
    a, b, c = instances()
    index = KVIndex()
    # A weight that keeps the cost function on the holder: only the spill moves the flood.
    picker = Picker("cache", [a, b, c], index, Weights(overlap=8.0))
    store(index, a.url, keys(7, 8))  # a holds 8 of each prompt's 10 blocks: it needs 2
    choices = [queue(picker, hot_prompt(n)) for n in range(6)]
    # a takes prompts while the prefill ahead there and the prompt's own (2 each) is no more
    # than the 10 blocks elsewhere: 0, 2, 4, 6, 8 blocks ahead; at 10 the sixth spills.
    assert [ch.instance for ch in choices[:5]] == [a] * 5 and not any(
        ch.spilled for ch in choices[:5]
    )
    assert choices[5].spilled and choices[5].instance in (b, c) and choices[5].cached == 0.0
    assert a.ahead_blocks == 10.0
    # Once a's requests began (their first tokens came), only the decoding is left there.
    a.unstarted, a.ahead_blocks = 0, 0.0
    assert queue(picker, hot_prompt(6)).instance is a


def test_other_clients_waiting_requests_count_as_prefill_ahead_at_the_mean_need():
    a, b = instances(2)
    index = KVIndex()
    picker = Picker("cache", [a, b], index, Weights(overlap=8.0))
    store(index, a.url, keys(7, 8))
    assert queue(picker, hot_prompt(0)).instance is a  # mean need 2 from now on
    a.load = Load(waiting=5, free_blocks=100, total_blocks=100)  # its own 1 among them
    a.unstarted_at_load = 1
    # Ahead on a: its own 2, and 4 of other clients at 2 = 10; with its 2: 12 > 10 on b.
    assert picker.ahead(a) == 10.0
    choice = queue(picker, hot_prompt(1))
    assert choice.spilled and choice.instance is b


def test_requests_decoding_on_the_holder_cost_the_next_their_mean_need_not_their_prompt():
    a, b = instances(2)
    index = KVIndex()
    picker = Picker("cache", [a, b], index)
    store(index, a.url, keys(7, 8))
    # Four users behind the prefix, each with 2 blocks of its own, all decoding on a.
    assert [send(picker, hot_prompt(n)) for n in range(4)] == [a] * 4
    assert (picker.mean_need(), picker.mean_blocks()) == (2.0, 10.0)
    # The fifth: on a, 4 * 2 + 4 * 2 = 16 against 4 * 10 = 40 on b. Counted at their whole
    # prompt (4 * 10 = 40), the four would have sent it to recompute the prefix on b.
    choice = picker.choose(hot_prompt(4))
    assert choice is not None and choice.instance is a and picker.load(a) == 8.0


def test_a_spill_recomputes_the_prefix_only_where_no_prefill_is_queued():
    a, b, c = instances()
    index = KVIndex()
    picker = Picker("cache", [a, b, c], index, Weights(overlap=8.0))
    store(index, a.url, keys(7, 8))
    a.in_flight, a.unstarted, a.ahead_blocks = 6, 6, 12.0  # 6 prompts not begun, 2 blocks each
    b.in_flight, b.unstarted, b.ahead_blocks = 1, 1, 1.0
    c.in_flight, c.unstarted, c.ahead_blocks = 1, 1, 2.0
    # Before the prompt's first token: 12 + 2 on a, 1 + 10 on b, 2 + 10 on c. Both b and c
    # have prefill queued: recomputing the prefix there would delay what queues behind it.
    choice = picker.choose(hot_prompt(0))
    assert choice is not None and choice.instance is a and not choice.spilled
    c.in_flight, c.unstarted, c.ahead_blocks = 0, 0, 0.0  # c idle: 10 < 14, its capacity free
    choice = picker.choose(hot_prompt(1))
    assert choice is not None and choice.instance is c and choice.spilled
    # An instance that holds as much of the prompt takes the spill whatever its queue.
    a, b = instances(2)
    index = KVIndex()
    picker = Picker("cache", [a, b], index)
    store(index, a.url, keys(7, 10))
    store(index, b.url, keys(7, 10))
    a.in_flight, a.unstarted, a.ahead_blocks = 6, 6, 12.0
    b.in_flight, b.unstarted, b.ahead_blocks = 7, 1, 1.0
    choice = picker.choose(keys(7, 10))  # the cost function's choice: a (6 < 7 in flight)
    assert choice is not None and choice.instance is b and choice.spilled


def test_the_instances_own_word_counts_requests_this_router_did_not_send():
    a, b = instances(2)
    picker = Picker("least_loaded", [a, b], None)
    a.load = Load(running=3, waiting=2, free_blocks=100, total_blocks=100)
    b.in_flight = 2
    assert picker.choose(keys(1, 4)).instance is b  # type: ignore[union-attr]  # 5 > 2
    b.load = Load(running=9, free_blocks=100, total_blocks=100)
    assert picker.choose(keys(1, 4)).instance is a  # type: ignore[union-attr]  # 5 < 2 + 9
    # Words a tick old: of b's 9, the 2 of this router in flight then are not counted twice,
    # nor, once they ended, at all.
    b.in_flight_at_load = 2
    b.in_flight = 0
    a.load = Load(running=8, free_blocks=100, total_blocks=100)
    assert picker.choose(keys(1, 4)).instance is b  # type: ignore[union-attr]  # 7 < 8


def test_too_few_free_blocks_cost_what_the_prompt_must_wait_for():
    a, b = instances(2)
    index = KVIndex()
    picker = Picker("cache", [a, b], index, Weights(overlap=1.0))
    store(index, a.url, keys(1, 4))
    a.load = Load(free_blocks=2, total_blocks=64)  # needs 6 more, has 2: short 4
    b.load = Load(free_blocks=64, total_blocks=64)
    # a: need 6 + short 4 = 10 against b: need 10 + short 0 = 10: a tie, to the most cached.
    assert picker.choose(keys(1, 10)).instance is a  # type: ignore[union-attr]
    a.load = Load(free_blocks=1, total_blocks=64)  # short 5: 11 > 10
    assert picker.choose(keys(1, 10)).instance is b  # type: ignore[union-attr]


def test_a_cleared_or_dead_instance_is_scored_as_holding_nothing():
    a, b = instances(2)
    index = KVIndex()
    picker = Picker("cache", [a, b], index)
    store(index, a.url, keys(1, 8))
    store(index, b.url, keys(1, 4))
    assert picker.choose(keys(1, 8)).instance is a  # type: ignore[union-attr]
    index.apply(a.url, AllBlocksCleared(medium="GPU"))  # its Worker restarted
    assert picker.choose(keys(1, 8)).instance is b  # type: ignore[union-attr]
    store(index, a.url, keys(1, 8))
    picker.mark_down(a)
    assert picker.choose(keys(1, 8)).instance is b  # type: ignore[union-attr]
    assert index.overlap(keys(1, 8))[a.url].blocks == 0
    picker.mark_up(a)
    picker.mark_down(b)
    choice = picker.choose(keys(1, 8))
    assert choice is not None and choice.instance is a and choice.cached == 0.0
    picker.mark_down(a)
    assert picker.choose(keys(1, 8)) is None


def test_approximate_remembers_where_it_sent_each_prefix():
    a, b, c = instances()
    picker = Picker("approximate", [a, b, c], None)
    first = send(picker, keys(1, 8))
    first.in_flight = 0
    for _ in range(3):
        chosen = send(picker, keys(1, 8))
        assert chosen is first
        chosen.in_flight = 0
    other = send(picker, keys(2, 8))
    assert other is not first


def test_round_robin_takes_turns_and_skips_an_instance_down():
    a, b, c = instances()
    picker = Picker("round_robin", [a, b, c], None)
    assert [send(picker, []) for _ in range(4)] == [a, b, c, a]
    picker.mark_down(b)
    assert [send(picker, []) for _ in range(3)] == [c, a, c]


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="--policy must be one of"):
        Picker("random", instances(), None)


def test_the_command_line_offers_the_policies_and_the_default_weight():
    assert POLICY_CHOICES == POLICIES
    assert (
        OVERLAP_WEIGHT
        == DEFAULT_OVERLAP_WEIGHT
        == Weights().overlap
        == RouterOptions(instances=("http://a",)).overlap_weight
    )

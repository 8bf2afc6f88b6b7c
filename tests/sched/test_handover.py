"""Prefill/decode hand-over in the scheduler: a prefill instance's writes, a decode
instance's reservations, checked by the symbolic simulator's KV oracle.

A prefill scheduler (``handover``) and a decode scheduler share one storage dict: what
the prefill side writes when its requests finish is what the decode side prefetches,
and every step of the decode side reads exactly the KV of its own sequence.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from test_scheduler import (  # type: ignore[import-not-found]  # the sibling module, by pytest
    FakeStorage,
    Sim,
    expected_output,
    make_request,
    make_scheduler,
)

from ringfence.cache.fences import Lane
from ringfence.sched.ops import StoreOp, SwapOp
from ringfence.sched.request import RequestError
from ringfence.sched.reservations import Refusal, Reservation, Reservations
from ringfence.sched.scheduler import Scheduler

BS = 4


def prefill_side(storage: dict[Any, Any], *, device_blocks: int = 64, host_blocks: int = 4) -> Sim:
    base = make_scheduler(
        device_blocks=device_blocks, host_blocks=host_blocks, storage=FakeStorage(storage),
        block_size=BS,
    )  # fmt: skip
    config = dataclasses.replace(base.config, handover=True)
    return Sim(Scheduler(config, FakeStorage(storage)), storage=storage)


def decode_side(
    storage: dict[Any, Any], *, device_blocks: int = 64, reserve_blocks: int = -1
) -> Sim:
    base = make_scheduler(
        device_blocks=device_blocks, host_blocks=64, storage=FakeStorage(storage), block_size=BS,
        preemption="save",
    )  # fmt: skip
    sched = dataclasses.replace(base.config.sched, reserve_blocks=reserve_blocks)
    config = dataclasses.replace(base.config, sched=sched)
    return Sim(Scheduler(config, FakeStorage(storage)), storage=storage)


def claim(sim: Sim, request, reservation: str) -> None:
    """Add ``request`` to the simulated decode side, claiming ``reservation``."""
    sim.requests[sim.sched.add(request, reservation)] = request


def prompt(seed: int, length: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1, 50) for _ in range(length))


# The rule.


def test_a_reservation_counts_a_requests_whole_life_by_default_and_its_prompt_with_a_cap():
    whole, capped = Reservations(BS, -1), Reservations(BS, 3)
    assert whole.blocks_for(10, 7) == 5  # 17 tokens
    assert capped.blocks_for(10, 7) == 3  # 11 tokens: the prompt and its first token
    lives = [(10, 7, 3), (4, 4, 2)]  # growth 2 and 0
    assert whole.growth(lives) == 2
    assert Reservations(BS, 1).growth(lives) == 1


def test_a_reservation_is_granted_only_beside_the_headroom_and_the_other_reservations():
    r = Reservations(BS, -1)
    first = r.grant("a", (1,) * 8, 8, free_blocks=10, headroom=2, expires_at=5.0)
    assert isinstance(first, Reservation) and first.blocks == 4
    second = r.grant("b", (1,) * 8, 8, free_blocks=10, headroom=2, expires_at=5.0)
    assert isinstance(second, Reservation)
    third = r.grant("c", (1,) * 8, 8, free_blocks=10, headroom=2, expires_at=5.0)
    assert isinstance(third, Refusal) and third.retry
    assert "needs 4 blocks; 10 are free, 2 kept" in third.reason and "8 reserved" in third.reason
    assert r.num_blocks == 8 and set(r.live) == {"a", "b"}


def test_a_claim_takes_its_reservation_only_for_the_request_reserved():
    r = Reservations(BS, -1)
    r.grant("a", (1, 2, 3), 4, free_blocks=10, headroom=0, expires_at=5.0)
    with pytest.raises(ValueError, match="another prompt"):
        r.claim("a", (1, 2, 4), 4)
    with pytest.raises(ValueError, match="max_tokens 4, the request asks 5"):
        r.claim("a", (1, 2, 3), 5)
    assert r.claim("a", (1, 2, 3), 4).reservation_id == "a"
    with pytest.raises(KeyError):
        r.claim("a", (1, 2, 3), 4)


def test_a_reservation_expires_only_when_due_and_only_once():
    r = Reservations(BS, -1)
    r.grant("a", (1, 2, 3), 4, free_blocks=10, headroom=0, expires_at=5.0)
    assert r.expire("a", 4.9) is None
    assert r.expire("a", 5.0) is not None
    assert r.expire("a", 6.0) is None and not r.live


def test_the_scheduler_refuses_for_good_a_reservation_that_can_never_run():
    decode = decode_side({}, device_blocks=8)
    refusal = decode.sched.reserve("x", (1,) * 30, 8, 1.0)
    assert isinstance(refusal, Refusal) and not refusal.retry
    assert "device pool has 8" in refusal.reason


def test_a_claim_of_a_reservation_not_live_is_a_request_error_naming_it():
    decode = decode_side({})
    with pytest.raises(RequestError, match="'gone' expired or was never granted") as e:
        decode.sched.add(make_request("r", (1, 2, 3)), "gone")
    assert e.value.field == "reservation"


# Prefill: the hand-over writes.


def test_a_prefill_writes_every_full_block_of_a_finished_request_and_reports_them_stored():
    storage: dict[Any, Any] = {}
    sim = prefill_side(storage)
    tokens = prompt(1, 4 * BS + 2)  # four full blocks and a partial one
    sim.run([(0, make_request("p", tokens, max_tokens=1))])
    (handover,) = sim.sched.handovers.take()
    assert len(handover.keys) == 4 and handover.present == frozenset()
    writes = [op for op in sim.ops if isinstance(op, StoreOp) and op.reason == "handover"]
    assert [k for op in writes for k in op.keys] == list(handover.keys)
    assert handover.mark == max(op.op for op in writes)
    assert set(handover.keys) <= set(storage)  # the simulator checked each blob's contents
    assert sim.sched.handovers.stored_blocks(handover) == 4


def test_a_prefill_writes_in_rounds_when_the_host_pool_is_smaller_than_the_prompt():
    storage: dict[Any, Any] = {}
    sim = prefill_side(storage, host_blocks=2)
    sim.run([(0, make_request("p", prompt(2, 7 * BS), max_tokens=1))])
    (handover,) = sim.sched.handovers.take()
    writes = [op for op in sim.ops if isinstance(op, StoreOp) and op.reason == "handover"]
    assert [len(op.keys) for op in writes] == [2, 2, 2, 1]
    assert sim.sched.handovers.stored_blocks(handover) == 7


def test_a_block_storage_held_already_is_not_written_again_but_counts_as_stored():
    storage: dict[Any, Any] = {}
    first = prefill_side(storage)
    first.run([(0, make_request("a", prompt(3, 3 * BS), max_tokens=1))])
    second = prefill_side(storage)  # another prefill instance on the same tier
    second.run([(0, make_request("b", prompt(3, 3 * BS) + prompt(4, 2 * BS), max_tokens=1))])
    (handover,) = second.sched.handovers.take()
    assert len(handover.present) == 3
    writes = [op for op in second.ops if isinstance(op, StoreOp) and op.direction == "write"]
    written = [k for op in writes for k in op.keys]
    assert len(written) == 2 and second.sched.handovers.stored_blocks(handover) == 5


def test_a_failed_write_leaves_the_stored_count_at_the_blocks_before_it():
    storage: dict[Any, Any] = {}
    sim = prefill_side(storage, host_blocks=2)
    sim.add(make_request("p", prompt(5, 6 * BS), max_tokens=1))
    for _ in range(20):
        sim.issue()
        sim.apply_step()
        if sim.sched.idle and not sim.step_in_flight:
            break
    (handover,) = sim.sched.handovers.take()
    writes = [p for p in sim.pending if isinstance(p.op, StoreOp)]
    assert len(writes) == 3
    writes[1].status = "failed"  # blocks 2 and 3
    sim.complete(everything=True)
    assert sim.sched.handovers.stored_blocks(handover) == 2


# Decode: reservations, and the prefill's blocks prefetched.


def test_a_decode_side_computes_only_what_the_prefill_side_did_not_hand_over():
    storage: dict[Any, Any] = {}
    rng = random.Random(7)
    prompts = [prompt(rng.randrange(1000), rng.randrange(2, 9) * BS + rng.randrange(BS))
               for _ in range(6)]  # fmt: skip
    prefill = prefill_side(storage)
    prefill.run([(0, make_request(f"p{i}", p, max_tokens=1)) for i, p in enumerate(prompts)])
    decode = decode_side(storage)
    requests = []
    for i, p in enumerate(prompts):
        granted = decode.sched.reserve(f"r{i}", p, 6, 1.0)
        assert isinstance(granted, Reservation), granted
        requests.append(make_request(f"d{i}", p, max_tokens=6))
        claim(decode, requests[-1], f"r{i}")
    decode.run()
    for p, request in zip(prompts, requests, strict=True):
        assert list(request.output_token_ids) == expected_output(p, 6)
        assert request.cached_tokens["storage"] == (len(p) - 1) // BS * BS
    assert not decode.sched.reservations.live


def test_a_flood_of_long_prompts_never_preempts_a_running_decode():
    """The seed report's decode-side reservation: room is granted only beside the growth
    the running requests may still need, so admissions never take a running one's blocks."""
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    decode = decode_side({}, device_blocks=24)
    running = make_request("long-decode", prompt(9, 2 * BS), max_tokens=40)  # 12 blocks of life
    assert isinstance(decode.sched.reserve("r0", running.prompt_token_ids, 40, 1e9), Reservation)
    claim(decode, running, "r0")
    granted = refused = 0
    flood = 0
    for _ in range(400):
        if not running.is_finished or flood < 30:
            flood += 1
            tokens = prompt(rng.randrange(1 << 20), rng.randrange(4, 10) * BS)
            answer = decode.sched.reserve(f"f{flood}", tokens, 8, 1e9)
            if isinstance(answer, Reservation):
                granted += 1
                claim(decode, make_request(f"flood-{flood}", tokens, max_tokens=8), f"f{flood}")
            else:
                assert answer.retry, answer
                refused += 1
        if decode.sched.idle and not decode.pending:
            break
        decode.one_round()
        if not decode.sched.idle:
            assert sum(decode.sched.counters.preemptions.values()) == 0
    decode.run()
    assert running.is_finished and list(running.output_token_ids) == expected_output(
        running.prompt_token_ids, 40
    )
    assert sum(decode.sched.counters.preemptions.values()) == 0
    assert granted > 0 and refused > 0  # the flood was both admitted and held back


def test_with_a_headroom_cap_more_requests_fit_and_outgrowing_it_preempts_by_save():
    storage: dict[Any, Any] = {}
    decode = decode_side(storage, device_blocks=16, reserve_blocks=0)
    requests = []
    for i in range(3):
        tokens = prompt(20 + i, 3 * BS)
        answer = decode.sched.reserve(f"r{i}", tokens, 12, 1e9)
        assert isinstance(answer, Reservation) and answer.blocks == 4, answer
        requests.append(make_request(f"d{i}", tokens, max_tokens=12))
        claim(decode, requests[-1], f"r{i}")
    decode.run()
    for request in requests:
        assert list(request.output_token_ids) == expected_output(request.prompt_token_ids, 12)
    assert decode.sched.counters.preemptions["save"] > 0
    saved = [op for op in decode.ops if isinstance(op, SwapOp) and op.reason == "preempt"]
    assert saved and decode.sched.blocks.issuer.last_number(Lane.STORE) > 0

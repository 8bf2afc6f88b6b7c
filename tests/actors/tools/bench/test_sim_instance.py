"""The simulated instance (actors/tools/bench/serving/sim_engine.py and sim_instance.py) in
this process: the modelled time a cached prefix saves, LRU eviction and its events,
chunked prefill under the token budget, first-come-first-served admission, the load word
and its long poll, and the answers as a real instance words them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import orjson
import pytest
from fake_serve import listening_socket

from ringfence.actors.events.wire import decode_batch
from ringfence.actors.http.load import Load
from ringfence.actors.serve.server import HttpThread
from ringfence.actors.tools.bench.serving import sim_instance
from ringfence.actors.tools.bench.serving.instance_api import BLOCK_SIZE, NAMESPACE
from ringfence.actors.tools.bench.serving.sim_engine import (
    CostModel,
    PoolExhausted,
    SimEngine,
    SimRequest,
    Step,
)
from ringfence.cache.block_hash import block_keys
from ringfence.cache.kv_events import BlockRemoved, BlockStored

STOP_S = 5.0


def make_engine(**model: float) -> SimEngine:
    return SimEngine(CostModel(**model))  # type: ignore[arg-type]


def prompt(seed: int, tokens: int) -> list[int]:
    return [seed * 1000 + k + 1 for k in range(tokens)]


def run_to_end(engine: SimEngine) -> list[Step]:
    """Every step until the engine is idle (each one ended at once)."""
    steps = []
    while engine.has_work:
        step = engine.schedule()
        engine.finish(step)
        steps.append(step)
    return steps


def shape(step: Step) -> tuple[list[tuple[int, int]], list[int]]:
    """A step as (request id, prompt tokens) pairs and the decoding requests' ids."""
    return [(r.id, n) for r, n in step.prefill], [r.id for r in step.decode]


def test_a_cached_prefix_shortens_the_modelled_time_by_exactly_its_prefill():
    model = CostModel(step_ms=4.0, prefill_ms_per_token=0.05, decode_ms_per_seq=0.05)
    engine = SimEngine(model)
    first = engine.add(prompt(1, 10 * BLOCK_SIZE + 5), 2)
    cold = engine.schedule()
    assert shape(cold) == ([(first.id, 165)], [])
    engine.finish(cold)
    run_to_end(engine)
    # The same ten blocks, another tail: the hit covers them, only the tail is prefilled.
    again = engine.add([*prompt(1, 10 * BLOCK_SIZE), 7, 8, 9, 10, 11], 2)
    warm = engine.schedule()
    assert shape(warm) == ([(again.id, 5)], []) and again.cached_tokens == 160
    saved = model.step_s(cold.prefill_tokens, 0) - model.step_s(warm.prefill_tokens, 0)
    assert saved == pytest.approx(model.prefill_ms_per_token * 160 / 1000)


def test_a_whole_cached_prompt_still_computes_its_last_token():
    engine = make_engine()
    engine.add(prompt(1, 2 * BLOCK_SIZE), 1)
    run_to_end(engine)
    again = engine.add(prompt(1, 2 * BLOCK_SIZE), 1)
    step = engine.schedule()
    # The hit stops a block short: the last block holds the token whose logits are needed.
    assert shape(step) == ([(again.id, BLOCK_SIZE)], []) and again.cached_tokens == BLOCK_SIZE


def test_lru_eviction_publishes_block_removed_and_the_blocks_are_then_a_miss():
    engine = make_engine(blocks=6)
    a = prompt(1, 3 * BLOCK_SIZE)
    keys = block_keys(a, BLOCK_SIZE, namespace=NAMESPACE)
    engine.add(a, BLOCK_SIZE)  # 4 blocks: its 3 prompt blocks (cached when done) and 1
    stored = [event for step in run_to_end(engine) for event in step.stored]
    assert stored == [BlockStored(keys=tuple(keys), parent=None, token_ids=tuple(a),
                                  block_size=BLOCK_SIZE, medium="GPU")]  # fmt: skip
    assert engine.load().free_blocks == 6  # cached blocks count as free
    # 5 blocks for another prompt: the 3 empty ones, then a's tail blocks, last first.
    engine.add(prompt(2, 3 * BLOCK_SIZE), 2 * BLOCK_SIZE)
    step = engine.schedule()
    assert step.removed == (BlockRemoved(keys=(keys[2], keys[1]), medium="GPU"),)
    engine.finish(step)
    run_to_end(engine)
    back = engine.add(a, 1)
    engine.schedule()
    assert back.cached_tokens == BLOCK_SIZE  # only its first block is still cached


def test_a_long_prefill_is_chunked_under_the_token_budget_and_decodes_go_first():
    engine = make_engine(max_batched_tokens=64)
    a = engine.add(prompt(1, 100), 3)
    b = engine.add(prompt(2, 40), 2)
    steps = run_to_end(engine)
    assert [shape(s) for s in steps] == [
        ([(a.id, 64)], []),  # the budget spent: b waits
        ([(a.id, 36), (b.id, 28)], []),  # a's rest; b admitted with what is left
        ([(b.id, 12)], [a.id]),  # a decodes (1 token of the budget) before b's chunk
        ([], [a.id, b.id]),
    ]
    assert a.output == [a.token_at(k) for k in range(3)] and len(b.output) == 2


def test_admission_is_first_come_first_served_even_when_a_later_request_would_fit():
    engine = make_engine(blocks=8)
    big = engine.add(prompt(1, 4 * BLOCK_SIZE), 2 * BLOCK_SIZE)  # 6 blocks
    bigger = engine.add(prompt(2, 4 * BLOCK_SIZE), 2 * BLOCK_SIZE)  # 6: waits for big
    small = engine.add(prompt(3, 8), 8)  # 1 block, free now, but behind bigger
    first = engine.schedule()
    assert shape(first) == ([(big.id, 4 * BLOCK_SIZE)], [])
    assert list(engine.waiting) == [bigger, small]
    engine.finish(first)
    steps = run_to_end(engine)
    admitted = [r.id for s in steps for r, n in s.prefill if n and r.computed == n]
    assert admitted == [bigger.id, small.id]  # once big finished, in their order


def test_no_more_than_max_num_seqs_run_at_once():
    engine = make_engine(max_num_seqs=1)
    one, two = engine.add(prompt(1, 8), 2), engine.add(prompt(2, 8), 2)
    assert [shape(s) for s in run_to_end(engine)] == [
        ([(one.id, 8)], []), ([], [one.id]), ([(two.id, 8)], []), ([], [two.id]),
    ]  # fmt: skip


def test_tokens_depend_on_the_prompt_and_position_alone():
    first, second = make_engine(), make_engine(blocks=64, step_ms=1.0)
    second.add(prompt(9, 20), 3)  # another request before it changes nothing
    mine = [first.add(prompt(1, 20), 4), second.add(prompt(1, 20), 4)]
    run_to_end(first)
    run_to_end(second)
    assert mine[0].output == mine[1].output and len(set(mine[0].output)) == 4
    other = SimRequest(id=0, prompt=tuple(prompt(2, 20)), max_tokens=1)
    assert other.token_at(0) != mine[0].output[0]


def test_a_prompt_larger_than_the_pool_or_a_bad_model_is_refused_by_name():
    with pytest.raises(PoolExhausted, match="need 3 blocks; the pool has 2"):
        make_engine(blocks=2).add(prompt(1, 40), 1)
    with pytest.raises(ValueError, match="step_ms must be >= 0"):
        CostModel(step_ms=-1.0)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        CostModel(max_num_seqs=0)


class Published:
    """A stand-in publisher: the batches handed to it, decoded."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def publish(self, payload: bytes) -> None:
        self.events.extend(decode_batch(payload).events)


def test_the_runner_notes_each_load_change_and_wakes_a_held_poll():
    async def scenario() -> None:
        runner = sim_instance.Runner(make_engine(blocks=16), None)
        assert runner.watch.seq == 1
        poll = asyncio.ensure_future(runner.watch.after(1, 30.0))
        await asyncio.sleep(0)  # the poll is held on the watch now
        assert not poll.done()
        request, tokens = runner.submit(prompt(1, 20), 2)
        seq, load = await poll
        assert seq >= 2 and load.running + load.waiting == 1
        assert [await tokens.get(), await tokens.get()] == request.output
        runner.end(request)
        # Numbered by change only: the arrival (2), the admission (3), and the end (4), but
        # not the two steps' ends and the second's start, which left the load as it was.
        assert runner.watch.load == Load(free_blocks=16, total_blocks=16)
        assert runner.watch.seq == 4

    asyncio.run(scenario())


def test_the_runner_publishes_removed_blocks_at_once_and_stored_ones_as_steps_end():
    async def scenario() -> list[object]:
        published = Published()
        runner = sim_instance.Runner(make_engine(blocks=4), published)  # type: ignore[arg-type]
        for seed in (1, 2):
            request, tokens = runner.submit(prompt(seed, 2 * BLOCK_SIZE + 1), BLOCK_SIZE)
            for _ in range(BLOCK_SIZE):
                await tokens.get()
            runner.end(request)
        return published.events

    events = asyncio.run(scenario())
    one, two = (block_keys(prompt(s, 2 * BLOCK_SIZE + 1), BLOCK_SIZE, namespace=NAMESPACE)
                for s in (1, 2))  # fmt: skip
    assert [type(e).__name__ for e in events] == ["BlockStored", "BlockRemoved", "BlockStored"]
    assert events[0].keys == tuple(one) and events[2].keys == tuple(two)  # type: ignore[attr-defined]
    assert events[1] == BlockRemoved(keys=(one[1], one[0]), medium="GPU")


@pytest.fixture
def sim() -> Iterator[str]:
    sock = listening_socket("127.0.0.1", 0)
    app = sim_instance.build_app(CostModel(step_ms=1.0, blocks=64))
    http = HttpThread(app, sock, asyncio.new_event_loop())
    http.start()
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    assert http.stop(STOP_S), "the sim did not stop"


def test_a_streamed_answer_gives_a_token_an_event_then_usage_with_the_cached_tokens(sim):
    body = {"prompt": prompt(1, 40), "max_tokens": 3, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.Client(trust_env=False, base_url=sim) as client:
        first = client.post("/v1/completions", json=body)
        again = client.post("/v1/completions", json=body)
        whole = client.post("/v1/completions", json={"prompt": prompt(1, 40), "max_tokens": 3})
        load = client.get("/ringfence/load?after=0").json()
    chunks = [orjson.loads(line.removeprefix("data: ")) for line in again.text.split("\n\n")[:-2]]
    assert again.text.endswith("data: [DONE]\n\n")
    tokens = [c["choices"][0]["token_ids"][0] for c in chunks[:3]]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
    before = [orjson.loads(line.removeprefix("data: ")) for line in first.text.split("\n\n")[:3]]
    assert [c["choices"][0]["token_ids"][0] for c in before] == tokens  # the same tokens
    usage = chunks[3]["usage"]
    assert chunks[3]["choices"] == [] and usage == {
        "prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
        "prompt_tokens_details": {"cached_tokens": 32},
        "ringfence": {"cached_tokens": {"device": 32, "host": 0, "storage": 0}},
    }  # fmt: skip
    answer = whole.json()
    assert answer["choices"][0]["text"] == "".join(f" t{t}" for t in tokens)
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert {k: load[k] for k in ("running", "waiting", "free_blocks", "total_blocks")} == {
        "running": 0, "waiting": 0, "free_blocks": 64, "total_blocks": 64,
    }  # fmt: skip


def test_the_load_route_answers_at_once_past_after_and_holds_a_poll_otherwise(sim):
    with httpx.Client(trust_env=False, base_url=sim) as client:
        now = client.get("/ringfence/load?after=0&wait_s=30").json()
        held = client.get(f"/ringfence/load?after={now['seq']}&wait_s=0.05").json()
        assert client.get("/ringfence/load?after=x").status_code == 400
        refused = client.post("/v1/completions", json={"prompt": prompt(1, 2000)})
    assert now == held == {"seq": 1, "pending": 0, "running": 0, "waiting": 0,
                           "reservations": 0, "free_blocks": 64, "total_blocks": 64}  # fmt: skip
    assert refused.status_code == 400 and "the pool has 64" in refused.text

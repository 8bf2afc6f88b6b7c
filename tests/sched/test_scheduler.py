"""The scheduler, driven by a symbolic simulator of the three lanes.

The simulator executes every op the scheduler issues in issue order (the sequential
semantics of docs/design.md, "Sequence numbers, watermarks, fences") on symbolic blocks: a
device or host block's contents map each slot to the token prefix whose KV it holds
(the KV at position p depends on tokens 0..p), storage maps a key to such contents.
A step checks that every position it reads holds exactly the KV of its own sequence
(the KV-correctness oracle), writes what it computes and samples a token that depends
only on the sequence's tokens. Every op's fence is checked against an independent
record of the last op of each lane that read or wrote each block.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from ringfence.cache.block_hash import block_keys
from ringfence.cache.config import Eviction
from ringfence.cache.fences import Lane
from ringfence.cache.ids import BlockHash, BlockId
from ringfence.sched.config import Preemption, SchedConfig, SchedulerConfig, TierConfig
from ringfence.sched.ops import Op, Opening, StepOp, StoreOp, SwapOp
from ringfence.sched.request import Request, RequestError, RequestState, SamplingParams
from ringfence.sched.scheduler import STEP_RETRIES, Scheduler

NAMESPACE = b"\0" * 16
S = RequestState
Contents = dict[int, tuple[int, ...]]  # slot -> the token prefix whose KV the slot holds


def next_token(tokens: tuple[int, ...]) -> int:
    """The fake model: a token that depends only on the whole sequence so far."""
    return sum((i + 1) * t for i, t in enumerate(tokens)) % 50 + 1


def expected_output(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        out.append(next_token(tuple(tokens)))
        tokens.append(out[-1])
    return out


def key_contents(
    tokens: tuple[int, ...], block_size: int, salt: str = ""
) -> dict[BlockHash, Contents]:
    """Storage entries for the full blocks of ``tokens`` (as another instance wrote them)."""
    keys = block_keys(tokens, block_size, namespace=NAMESPACE, salt=salt)
    return {
        key: {s: tokens[: i * block_size + s + 1] for s in range(block_size)}
        for i, key in enumerate(keys)
    }


class FakeStorage:
    """Storage presence over the simulator's storage dict."""

    def __init__(self, blobs: dict[BlockHash, Contents]) -> None:
        self.blobs = blobs

    def longest_prefix(self, keys: Iterable[BlockHash]) -> int:
        count = 0
        for key in keys:
            if key not in self.blobs:
                break
            count += 1
        return count


def make_scheduler(
    *,
    device_blocks: int = 64,
    host_blocks: int = 1,
    host_cache: bool = False,
    storage: FakeStorage | None = None,
    preemption: Preemption = "recompute",
    block_size: int = 4,
    max_num_seqs: int = 16,
    max_batched_tokens: int = 512,
    max_model_len: int = 1 << 30,
    vocab_size: int = 1 << 31,
    device_eviction: Eviction = "write_back",
    host_eviction: Eviction = "write_back",
    poison_freed: bool = False,
) -> Scheduler:
    tiers = TierConfig(
        block_size=block_size,
        device_blocks=device_blocks,
        host_blocks=host_blocks,
        host_cache=host_cache,
        storage=storage is not None,
        device_eviction=device_eviction,
        host_eviction=host_eviction,
        poison_freed=poison_freed,
    )
    config = SchedulerConfig(
        sched=SchedConfig(
            max_num_seqs=max_num_seqs,
            max_batched_tokens=max_batched_tokens,
            preemption=preemption,
        ),
        tiers=tiers,
        namespace=NAMESPACE,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
    )
    return Scheduler(config, storage)


def make_request(
    request_id: str,
    prompt: Iterable[int],
    max_tokens: int = 8,
    arrival: float = 0.0,
    cache_salt: str = "",
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=tuple(prompt),
        params=SamplingParams(max_tokens=max_tokens),
        arrival=arrival,
        cache_salt=cache_salt,
    )


class OracleError(AssertionError):
    pass


@dataclass
class Pending:
    due: int
    op: SwapOp | StoreOp
    status: str
    missing: tuple[int, ...]


@dataclass
class Sim:
    """Drives one scheduler: schedule, execute the ops in order, complete them, apply."""

    sched: Scheduler
    storage: dict[BlockHash, Contents] = field(default_factory=dict)
    completion_delay: int = 0  # rounds before a transfer's completion is delivered
    # (op) -> (status, missing positions) for a prefetch; None: the truth
    prefetch_outcome: Callable[[StoreOp], tuple[str, tuple[int, ...]] | None] | None = None
    reset_rounds: frozenset[int] = frozenset()  # rounds after whose issue the Worker restarts

    def __post_init__(self) -> None:
        self.bs = self.sched.config.tiers.block_size
        self.device: dict[int, Contents] = {}
        self.host: dict[int, Contents] = {}
        self.requests: dict[int, Request] = {}  # seq id -> request
        self.round = 0
        self.log: list[str] = []  # repr of every op, in issue order
        self.ops: list[Op] = []
        self.steps: list[tuple[StepOp, dict[int, int]]] = []  # step, seq id -> wanted before
        self.pending: list[Pending] = []
        self.incomplete_prefetches: set[int] = set()
        self.last_issued = {Lane.STEP: 0, Lane.SWAP: 0, Lane.STORE: 0}
        # (tier, lane) -> block -> (last write, last access), the fence oracle's record
        self.record: dict[tuple[str, Lane], dict[int, list[int]]] = {}
        self.prefetch_last_write: dict[int, int] = {}  # host block -> store op of its prefetch
        self.step_outputs: list[tuple[int, int]] = []
        self.step_in_flight: StepOp | None = None

    # Requests.

    def add(self, request: Request) -> int:
        seq_id = self.sched.add(request)
        self.requests[seq_id] = request
        return seq_id

    # One round: schedule, check, execute, complete transfers, apply the step.

    def issue(self) -> list[Op]:
        before = {sid: r.state for sid, r in self.requests.items()}
        wanted = {
            sid: r.num_tokens - r.num_computed_tokens
            for sid, r in self.requests.items()
            if r.state is S.RUNNING
        }
        ops = self.sched.schedule()
        self.round += 1
        self.check_admission_order(before)
        for op in ops:
            self.log.append(repr(op))
            self.ops.append(op)
            self.check_fence(op)
            self.execute(op)
        steps = [op for op in ops if isinstance(op, StepOp)]
        assert len(steps) <= 1
        if steps:
            self.check_step_shape(steps[0], wanted)
            self.steps.append((steps[0], wanted))
            self.step_in_flight = steps[0]
        return ops

    def complete(self, everything: bool = False) -> None:
        due = [p for p in self.pending if everything or p.due <= self.round]
        self.pending = [p for p in self.pending if p not in due]
        for p in due:
            if isinstance(p.op, StoreOp) and p.op.direction == "read":
                self.incomplete_prefetches.discard(p.op.op)
            self.sched.on_transfer(p.op.lane, p.op.number, p.status, p.missing)

    def apply_step(self) -> None:
        step = self.step_in_flight
        if step is not None:
            self.step_in_flight = None
            outputs, self.step_outputs = self.step_outputs, []
            self.sched.on_step(step.step, "ok", outputs)

    def one_round(self) -> list[Op]:
        ops = self.issue()
        if self.round in self.reset_rounds:
            self.reset_device()
            return ops
        self.complete()
        self.apply_step()
        return ops

    def reset_device(self) -> None:
        """A Worker restart: the device tier is lost, and so is every op in flight (its
        executor cancels it, or did it but its completion is dropped: the worst of both is
        modelled). The step's tokens never arrive."""
        self.device.clear()  # nothing a step may read
        for p in self.pending:
            op = p.op
            if isinstance(op, SwapOp) and op.direction == "out":
                for h in op.host_blocks:
                    self.host[h] = {}
            elif isinstance(op, StoreOp) and op.direction == "read":
                self.incomplete_prefetches.discard(op.op)
                for h in op.host_blocks:
                    self.host[h] = {}
            elif isinstance(op, StoreOp):
                for key in op.keys:  # cancelled before it wrote
                    self.storage.pop(key, None)
        self.pending.clear()
        self.step_in_flight, self.step_outputs = None, []
        self.sched.reset_device()

    def run(self, arrivals: Iterable[tuple[int, Request]] = (), max_rounds: int = 5000) -> None:
        """Rounds until every request is done; ``arrivals`` are (round, request) pairs."""
        queue = sorted(arrivals, key=lambda a: a[0])
        for _ in range(max_rounds):
            while queue and queue[0][0] <= self.round:
                self.add(queue.pop(0)[1])
            if self.sched.idle and not queue and not self.pending:
                return
            had_pending = bool(self.pending)
            ops = self.one_round()
            if not ops:
                if self.pending:
                    self.complete(everything=True)
                elif queue:
                    self.round = max(self.round, queue[0][0])
                elif not (had_pending or self.sched.idle):
                    raise AssertionError(
                        f"stuck: nothing scheduled with {self.sched.num_live} live"
                    )
        raise AssertionError(f"no end after {max_rounds} rounds")

    # Execution of the ops (the sequential semantics).

    def execute(self, op: Op) -> None:
        if isinstance(op, StepOp):
            self.execute_step(op)
        elif isinstance(op, SwapOp):
            for d, h in zip(op.device_blocks, op.host_blocks, strict=True):
                if op.direction == "out":
                    self.host[h] = dict(self.device.get(d, {}))
                else:
                    self.device[d] = dict(self.host.get(h, {}))
            self.pending.append(Pending(self.round + self.completion_delay, op, "ok", ()))
        else:
            self.execute_store(op)

    def execute_store(self, op: StoreOp) -> None:
        if op.direction == "write":
            for h, key in zip(op.host_blocks, op.keys, strict=True):
                contents = self.host.get(h, {})
                self.check_blob(key, contents, f"write-back {op.op} of host block {h}")
                self.storage[key] = dict(contents)
            self.pending.append(Pending(self.round + self.completion_delay, op, "ok", ()))
            return
        missing = tuple(i for i, key in enumerate(op.keys) if key not in self.storage)
        status = "ok"
        if self.prefetch_outcome is not None and (chosen := self.prefetch_outcome(op)):
            status, extra = chosen
            missing = tuple(sorted(set(missing) | set(extra)))
        for i, (h, key) in enumerate(zip(op.host_blocks, op.keys, strict=True)):
            if status == "ok" and i not in missing:
                self.host[h] = dict(self.storage[key])
            else:
                self.host[h] = {}  # a failed read leaves garbage
        self.incomplete_prefetches.add(op.op)
        self.pending.append(Pending(self.round + self.completion_delay, op, status, missing))

    def check_blob(self, key: BlockHash, contents: Contents, what: str) -> None:
        bs = self.bs
        if sorted(contents) != list(range(bs)):
            raise OracleError(f"{what}: not a full block: {contents}")
        prefix = contents[bs - 1]
        for s in range(bs):
            if contents[s] != prefix[: len(prefix) - bs + s + 1]:
                raise OracleError(f"{what}: slot {s} holds another sequence's KV")
        if block_keys(prefix, bs, namespace=NAMESPACE)[-1] != key:
            raise OracleError(f"{what}: contents do not match key {key.hex()}")

    def execute_step(self, op: StepOp) -> None:
        bs = self.bs
        for b in op.poison:
            self.device[b] = {}
        written: dict[tuple[int, int], int] = {}
        read: dict[tuple[int, int], int] = {}
        for p in op.pieces:
            request = self.requests[p.seq_id]
            tokens = request.all_token_ids
            end = p.start + len(p.token_ids)
            assert tokens[p.start : end] == p.token_ids
            assert len(p.block_table) == -(-end // bs), p
            assert p.sample == (end == len(tokens)), p
            for pos in range(p.start):
                b = p.block_table[pos // bs]
                got = self.device.get(b, {}).get(pos % bs)
                if got != tokens[: pos + 1]:
                    raise OracleError(
                        f"step {op.step}: {request.request_id} reads position {pos} in device "
                        f"block {b}: holds {got}, should hold {tokens[: pos + 1]}"
                    )
                read[(b, pos % bs)] = p.seq_id
            for pos in range(p.start, end):
                b = p.block_table[pos // bs]
                assert (b, pos % bs) not in written, f"two pieces of step {op.step} write {b}"
                written[(b, pos % bs)] = p.seq_id
                self.device.setdefault(b, {})[pos % bs] = tokens[: pos + 1]
            if p.sample:
                self.step_outputs.append((p.seq_id, next_token(tokens)))
        for slot, seq_id in read.items():
            writer = written.get(slot)
            assert writer is None or writer == seq_id, f"step {op.step} reads what it writes"

    # Checks.

    def check_fence(self, op: Op) -> None:
        lane = op.lane
        assert op.number == self.last_issued[lane] + 1, f"{op} is not numbered in order"
        fence = op.fence
        assert getattr(fence, lane.value) == 0, f"{op} waits for its own lane"
        for other in Lane:
            assert getattr(fence, other.value) <= self.last_issued[other], (
                f"{op} names a {other} op not issued yet"
            )
        reads: dict[str, set[int]] = {"device": set(), "host": set()}
        writes: dict[str, set[int]] = {"device": set(), "host": set()}
        if isinstance(op, StepOp):
            reads["device"].update(op.poison)
            writes["device"].update(op.poison)
            for p in op.pieces:
                end = p.start + len(p.token_ids)
                reads["device"].update(p.block_table)
                writes["device"].update(p.block_table[p.start // self.bs : -(-end // self.bs)])
        elif isinstance(op, SwapOp):
            source, target = ("device", "host") if op.direction == "out" else ("host", "device")
            blocks = {"device": op.device_blocks, "host": op.host_blocks}
            reads[source].update(blocks[source])
            writes[target].update(blocks[target])
            if op.direction == "in":
                for h in op.host_blocks:
                    store_writer = self.prefetch_last_write.get(h)
                    assert store_writer not in self.incomplete_prefetches, (
                        f"swap-in {op.op} reads host block {h} before prefetch "
                        f"{store_writer} completed"
                    )
        else:
            (reads if op.direction == "write" else writes)["host"].update(op.host_blocks)
            if op.direction == "read":
                for h in op.host_blocks:
                    self.prefetch_last_write[h] = op.op
            else:
                for h in op.host_blocks:
                    self.prefetch_last_write.pop(h, None)
        if isinstance(op, SwapOp) and op.direction == "out":
            for h in op.host_blocks:
                self.prefetch_last_write.pop(h, None)
        others = {"device": {Lane.STEP: Lane.SWAP, Lane.SWAP: Lane.STEP}}
        others["host"] = {Lane.SWAP: Lane.STORE, Lane.STORE: Lane.SWAP}
        for tier in ("device", "host"):
            if not reads[tier] and not writes[tier]:
                continue
            other = others[tier][lane]
            record = self.record.setdefault((tier, other), {})
            need = max(
                [record.get(b, [0, 0])[0] for b in reads[tier]]
                + [record.get(b, [0, 0])[1] for b in writes[tier]]
            )
            assert getattr(fence, other.value) >= need, (
                f"{op} must wait for {other} op {need} on its {tier} blocks"
            )
            mine = self.record.setdefault((tier, lane), {})
            for b in reads[tier] | writes[tier]:
                mine.setdefault(b, [0, 0])[1] = op.number
            for b in writes[tier]:
                mine[b][0] = op.number
        self.last_issued[lane] = op.number

    def check_step_shape(self, op: StepOp, wanted: dict[int, int]) -> None:
        config = self.sched.config
        assert sum(len(p.token_ids) for p in op.pieces) <= config.sched.max_batched_tokens
        assert len(op.pieces) <= config.sched.max_num_seqs
        assert len({p.seq_id for p in op.pieces}) == len(op.pieces)
        kinds = [wanted.get(p.seq_id) == 1 for p in op.pieces]
        assert kinds == sorted(kinds, reverse=True), f"a decode after a prefill in {op}"

    def check_admission_order(self, before: dict[int, S]) -> None:
        waiting = (S.WAITING, S.PREEMPTED)
        admitted = [
            sid
            for sid, r in self.requests.items()
            if r.state is S.RUNNING and before.get(sid) is not S.RUNNING
        ]
        passed = [sid for sid, r in self.requests.items() if r.state in waiting]
        for sid in admitted:
            earlier = [p for p in passed if p < sid]
            assert not earlier, f"request {sid} overtook waiting {earlier}"

    def check_drained(self) -> None:
        blocks = self.sched.blocks
        assert self.sched.idle
        assert blocks.device.num_used == 0
        host = blocks.host
        used = [b for b in range(host.num_blocks) if host.ref_count(BlockId(b))]
        assert used == [], f"host blocks still in use: {used}"
        assert blocks.issuer.inflight == {}
        assert not self.pending


# The workload.


def make_workload(seed: int, count: int = 10) -> list[tuple[int, Request]]:
    """(arrival round, request) pairs; some prompts share a prefix. Prints its seed."""
    print(f"workload seed {seed}")
    rng = random.Random(seed)
    shared = tuple(rng.randrange(1, 50) for _ in range(12))
    out = []
    for i in range(count):
        length = rng.randrange(3, 22)
        if rng.random() < 0.4:
            prompt = shared[: min(length, 12)] + tuple(rng.randrange(1, 50) for _ in range(4))
        else:
            prompt = tuple(rng.randrange(1, 50) for _ in range(length))
        out.append((i * rng.randrange(0, 3), make_request(f"r{i}", prompt, rng.randrange(4, 12))))
    return out


def run_workload(seed: int, **config: Any) -> tuple[Sim, dict[str, list[int]]]:
    storage: dict[BlockHash, Contents] = {}
    if config.pop("with_storage", False):
        config["storage"] = FakeStorage(storage)
    sim = Sim(make_scheduler(**config), storage)
    arrivals = make_workload(seed)
    sim.run(arrivals)
    outputs = {r.request_id: list(r.output_token_ids) for _, r in arrivals}
    for _, r in arrivals:
        assert r.state is S.FINISHED, r
    return sim, outputs


SMALL: dict[str, Any] = {"device_blocks": 10, "max_num_seqs": 4, "max_batched_tokens": 16}
TIER_CASES = [
    pytest.param({"preemption": "recompute", "host_blocks": 1}, id="recompute-no-tiers"),
    pytest.param(
        {"preemption": "recompute", "host_blocks": 24, "host_cache": True}, id="recompute-host"
    ),
    pytest.param({"preemption": "swap", "host_blocks": 40, "host_cache": True}, id="swap-host"),
    pytest.param(
        {"preemption": "save", "host_blocks": 24, "host_cache": True, "with_storage": True},
        id="save-host-storage",
    ),
    pytest.param(
        {"preemption": "recompute", "host_blocks": 8, "with_storage": True},
        id="recompute-staging-storage",
    ),
    pytest.param(
        {"preemption": "save", "host_blocks": 8, "with_storage": True}, id="save-staging-storage"
    ),
    pytest.param(
        {
            "preemption": "recompute",
            "host_blocks": 8,
            "with_storage": True,
            "device_eviction": "write_through",
        },
        id="recompute-staging-storage-write-through",
    ),
]
for _policy in ("recompute", "swap", "save"):
    for _device, _host in (("write_through", "write_through"), ("write_back", "write_through")):
        TIER_CASES.append(
            pytest.param(
                {
                    "preemption": _policy,
                    "host_blocks": 40,
                    "host_cache": True,
                    "with_storage": True,
                    "device_eviction": _device,
                    "host_eviction": _host,
                    "poison_freed": True,
                },
                id=f"{_policy}-host-storage-{_device}-{_host}",
            )
        )


def small_sim(config: dict[str, Any], sim_cls: type[Sim] | None = None, **kwargs: Any) -> Sim:
    """A simulator of a SMALL scheduler with ``config``; "with_storage" gives it storage."""
    storage: dict[BlockHash, Contents] = {}
    config = dict(config)
    if config.pop("with_storage", False):
        config["storage"] = FakeStorage(storage)
    return (sim_cls or Sim)(make_scheduler(**SMALL, **config), storage, **kwargs)


@pytest.fixture(scope="module")
def reference_outputs() -> dict[int, dict[str, list[int]]]:
    out = {}
    for seed in (1, 2, 3):
        _, outputs = run_workload(seed, device_blocks=1000)
        out[seed] = outputs
    return out


# Tests.


def test_the_same_calls_in_the_same_order_give_the_same_ops():
    logs = []
    for _ in range(2):
        sim, _ = run_workload(
            7, preemption="swap", host_blocks=40, host_cache=True, with_storage=True, **SMALL
        )
        logs.append(sim.log)
    assert logs[0] == logs[1]
    assert len(logs[0]) > 20


def test_the_reference_run_gives_the_model_outputs(reference_outputs):
    for seed, outputs in reference_outputs.items():
        for _, r in make_workload(seed):
            assert outputs[r.request_id] == expected_output(r.prompt_token_ids, r.params.max_tokens)


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("config", TIER_CASES)
def test_every_request_finishes_with_the_reference_outputs_under_preemption(
    config, seed, reference_outputs
):
    policy = config["preemption"]
    sim, outputs = run_workload(seed, **SMALL, **config)
    assert outputs == reference_outputs[seed]
    assert sim.sched.counters.preemptions[policy] > 0, sim.sched.counters
    sim.check_drained()


@pytest.mark.parametrize("config", TIER_CASES)
def test_delayed_transfer_completions_give_the_same_outputs(config, reference_outputs):
    sim = small_sim(config, completion_delay=3)
    arrivals = make_workload(2)
    sim.run(arrivals)
    assert {r.request_id: r.output_token_ids for _, r in arrivals} == reference_outputs[2]
    sim.check_drained()


@pytest.mark.parametrize("delay", [0, 2])
@pytest.mark.parametrize("config", TIER_CASES)
def test_after_device_tier_resets_every_request_still_gets_the_reference_outputs(
    config, delay, reference_outputs
):
    resets = frozenset({4, 11, 23, 37})
    sim = small_sim(config, completion_delay=delay, reset_rounds=resets)
    arrivals = make_workload(3)
    sim.run(arrivals)
    assert {r.request_id: r.output_token_ids for _, r in arrivals} == reference_outputs[3]
    assert sim.sched.counters.resets == len(resets), sim.sched.counters
    sim.check_drained()


def test_a_reset_sends_running_requests_back_in_arrival_order_with_their_tokens_kept():
    sim = Sim(make_scheduler(device_blocks=16))
    for i in range(3):
        sim.add(make_request(f"r{i}", range(1 + i, 9 + i), max_tokens=6))
    for _ in range(3):
        sim.one_round()
    before = {r.request_id: list(r.output_token_ids) for r in sim.requests.values()}
    assert all(len(tokens) == 3 for tokens in before.values()), before
    sim.issue()
    sim.reset_device()
    assert sim.sched.num_running == 0 and sim.sched.blocks.device.num_used == 0
    assert [r.state for r in sim.requests.values()] == [S.PREEMPTED] * 3
    assert {r.request_id: list(r.output_token_ids) for r in sim.requests.values()} == before
    assert sim.sched.blocks.device.num_cached == 0  # no key survives: nothing is findable
    ops = sim.issue()
    step = ops[-1]
    assert isinstance(step, StepOp)
    assert [(p.seq_id, p.start, len(p.token_ids)) for p in step.pieces] == [
        (0, 0, 11),
        (1, 0, 11),
        (2, 0, 11),
    ]  # fmt: skip: the prompt and the 3 tokens so far, computed again
    sim.complete()
    sim.apply_step()
    sim.run()
    for r in sim.requests.values():
        assert list(r.output_token_ids) == expected_output(r.prompt_token_ids, 6)


def test_a_swap_preempted_request_whose_swap_out_failed_is_computed_again():
    sim = Sim(make_scheduler(device_blocks=6, host_blocks=16, host_cache=True, preemption="swap"))
    sim.add(make_request("a", range(1, 11), max_tokens=12))
    sim.add(make_request("b", range(11, 18), max_tokens=12))  # preempted with a partial block
    failed = []
    for _ in range(40):
        ops = sim.issue()
        outs = [op for op in ops if isinstance(op, SwapOp) and op.reason == "preempt"]
        for op in outs:  # the copy raised: the host blocks hold garbage
            failed.append(op.op)
            for h in op.host_blocks:
                sim.host[h] = {}
            sim.pending = [p for p in sim.pending if p.op is not op]
            sim.sched.on_transfer(Lane.SWAP, op.op, "failed")
        sim.complete()
        sim.apply_step()
        if sim.sched.idle:
            break
    assert failed, "nobody was swapped out"
    sim.run()
    for r in sim.requests.values():
        assert list(r.output_token_ids) == expected_output(r.prompt_token_ids, 12)
    sim.check_drained()


def test_a_step_respects_the_budget_the_batch_size_and_puts_decodes_first():
    sim, _ = run_workload(
        5, device_blocks=40, max_num_seqs=3, max_batched_tokens=7, preemption="recompute"
    )
    assert sim.steps
    assert max(len(step.pieces) for step, _ in sim.steps) == 3
    assert max(sum(len(p.token_ids) for p in step.pieces) for step, _ in sim.steps) == 7
    mixed = [
        step
        for step, wanted in sim.steps
        if any(wanted.get(p.seq_id) == 1 for p in step.pieces)
        and any(wanted.get(p.seq_id) != 1 for p in step.pieces)
    ]
    assert mixed, "the workload never mixes decodes and prefills"


def test_the_first_piece_opens_the_sequence_with_its_params_and_its_end_closes_it():
    sim = Sim(make_scheduler(device_blocks=16, max_batched_tokens=4))
    params = SamplingParams(max_tokens=3, temperature=0.7, top_p=0.3, seed=5)
    sim.add(Request(request_id="a", prompt_token_ids=(1, 2, 3, 4, 5, 6), params=params))
    sim.add(Request(request_id="b", prompt_token_ids=(9,), params=SamplingParams(max_tokens=5)))
    sim.run()
    pieces = [p for step, _ in sim.steps for p in step.pieces if p.seq_id == 0]
    assert len(pieces) == 4  # two prefill chunks, then two decodes
    assert [p.opening for p in pieces] == [Opening(params=params, num_prompt_tokens=6)] + [None] * 3
    closed = [step.closed for step, _ in sim.steps if step.closed]
    assert closed == [(0,)], "the step after a's end tells the Worker to forget it, once"


def test_a_penalised_sequence_opens_with_the_tokens_before_its_first_piece():
    sim = Sim(make_scheduler(device_blocks=16, max_batched_tokens=64))
    prompt = tuple(range(1, 10))  # two full blocks of 4 and one token
    sim.add(Request(request_id="a", prompt_token_ids=prompt, params=SamplingParams(max_tokens=1)))
    sim.run()
    params = SamplingParams(max_tokens=2, presence_penalty=0.5)
    sim.add(Request(request_id="b", prompt_token_ids=prompt, params=params))
    sim.run()
    [first, *rest] = [p for step, _ in sim.steps for p in step.pieces if p.seq_id == 1]
    assert first.start == 8, "the cached blocks are not computed again"
    assert first.opening == Opening(params=params, num_prompt_tokens=9, history=prompt[:8])
    assert all(p.opening is None for p in rest)


def test_a_preempted_sequence_is_opened_again_when_it_resumes():
    sim = Sim(make_scheduler(device_blocks=4, max_batched_tokens=64))
    sim.add(make_request("a", range(1, 9), max_tokens=6))
    sim.add(make_request("b", range(20, 28), max_tokens=6))
    sim.run()
    assert sim.sched.counters.preemptions, "the pool must be too small for both"
    openings = [p.seq_id for step, _ in sim.steps for p in step.pieces if p.opening]
    assert sorted(openings) != sorted(set(openings)), "a resumed sequence opens again"


def test_a_request_that_does_not_fit_is_not_overtaken():
    sim = Sim(make_scheduler(device_blocks=8, max_batched_tokens=64))
    sim.add(make_request("a", range(1, 21), max_tokens=8))  # 20 tokens: 5 blocks, then 7
    sim.one_round()
    sim.add(make_request("b", range(30, 46), max_tokens=2))  # 16 + 1 more: 5 blocks
    sim.add(make_request("c", [7], max_tokens=1))  # one block would fit
    sim.one_round()
    assert sim.requests[1].state is S.WAITING
    assert sim.requests[2].state is S.WAITING
    sim.run()
    assert sim.requests[2].output_token_ids == expected_output((7,), 1)
    sim.check_drained()


def state_of(request: Request) -> S:
    return request.state


def prefix_prompts() -> tuple[tuple[int, ...], tuple[int, ...]]:
    shared = tuple(range(10, 26))  # 16 tokens: 4 full blocks
    return (*shared, 1, 2, 3), (*shared, 4, 5)


def test_a_later_request_reuses_the_shared_prefix_on_device():
    first, second = prefix_prompts()
    sim = Sim(make_scheduler(device_blocks=64))
    sim.run([(0, make_request("a", first, 4))])
    sim.run([(sim.round, make_request("b", second, 4))])
    b = sim.requests[1]
    assert b.cached_tokens == {"device": 16, "host": 0, "storage": 0}
    assert b.output_token_ids == expected_output(second, 4)
    sim.check_drained()


def test_requests_with_another_cache_salt_share_no_block_and_those_with_the_same_do():
    first, second = prefix_prompts()
    sim = Sim(make_scheduler(device_blocks=64))
    sim.run([(0, make_request("a", first, 4, cache_salt="tenant-a"))])
    sim.run([(sim.round, make_request("b", second, 4, cache_salt="tenant-b"))])
    sim.run([(sim.round, make_request("plain", second, 4))])
    sim.run([(sim.round, make_request("a2", second, 4, cache_salt="tenant-a"))])
    b, plain, a2 = (sim.requests[i] for i in (1, 2, 3))
    assert b.cached_tokens == plain.cached_tokens == {"device": 0, "host": 0, "storage": 0}
    assert a2.cached_tokens == {"device": 16, "host": 0, "storage": 0}
    for request in (b, plain, a2):  # the same tokens, whatever was shared
        assert request.output_token_ids == expected_output(second, 4)
    sim.check_drained()


@pytest.mark.parametrize(
    ("stored", "asked", "cached"), [("s", "s", 16), ("s", "t", 0), ("", "s", 0)]
)
def test_a_stored_prefix_is_found_only_under_its_own_salt(stored, asked, cached):
    first, second = prefix_prompts()
    storage = key_contents(first, 4, salt=stored)
    sim = Sim(
        make_scheduler(device_blocks=16, host_blocks=8, storage=FakeStorage(storage)), storage
    )
    sim.run([(0, make_request("b", second, 4, cache_salt=asked))])
    b = sim.requests[0]
    assert b.cached_tokens == {"device": 0, "host": 0, "storage": cached}
    assert b.output_token_ids == expected_output(second, 4)
    sim.check_drained()


def test_a_later_request_reuses_the_shared_prefix_from_host():
    first, second = prefix_prompts()
    sim = Sim(make_scheduler(device_blocks=8, host_blocks=16, host_cache=True))
    sim.run([(0, make_request("a", first, 4))])
    sim.run([(sim.round, make_request("filler", range(30, 58), 4))])  # 8 blocks: evicts a's
    sim.add(make_request("b", second, 4))
    ops = sim.one_round()
    swaps = [op for op in ops if isinstance(op, SwapOp) and op.direction == "in"]
    assert len(swaps) == 1 and len(swaps[0].device_blocks) == 4
    assert swaps[0].reason == "admit"
    sim.run()
    b = sim.requests[2]
    assert b.cached_tokens == {"device": 0, "host": 16, "storage": 0}
    assert b.output_token_ids == expected_output(second, 4)
    sim.check_drained()


def test_a_later_request_prefetches_the_shared_prefix_from_storage_and_waits_for_it():
    first, second = prefix_prompts()
    storage = key_contents(first, 4)
    sim = Sim(
        make_scheduler(device_blocks=16, host_blocks=8, storage=FakeStorage(storage)),
        storage,
        completion_delay=2,
    )
    sim.add(make_request("b", second, 4))
    ops = sim.one_round()
    assert [type(op) for op in ops] == [StoreOp]
    (prefetch,) = ops
    assert isinstance(prefetch, StoreOp) and prefetch.direction == "read"
    assert len(prefetch.keys) == 4
    b = sim.requests[0]
    assert b.state is S.WAITING_FOR_PREFETCH
    assert sim.one_round() == []  # nothing reads the blocks before the completion
    assert b.state is S.WAITING_FOR_PREFETCH
    sim.complete(everything=True)
    assert state_of(b) is S.WAITING
    ops = sim.one_round()
    assert isinstance(ops[0], SwapOp) and ops[0].direction == "in"
    assert isinstance(ops[-1], StepOp) and ops[-1].pieces[0].start == 16
    sim.run()
    assert b.cached_tokens == {"device": 0, "host": 0, "storage": 16}
    assert b.output_token_ids == expected_output(second, 4)
    sim.check_drained()


@pytest.mark.parametrize(
    ("status", "missing", "cached"),
    [("failed", (), 0), ("ok", (2,), 8), ("ok", (0,), 0), ("ok", (3,), 12)],
)
def test_a_failed_prefetch_is_recomputed_and_never_fetched_again(status, missing, cached):
    first, second = prefix_prompts()
    storage = key_contents(first, 4)
    outcomes = {1: (status, missing)}
    sim = Sim(
        make_scheduler(device_blocks=16, host_blocks=8, storage=FakeStorage(storage)),
        storage,
        prefetch_outcome=lambda op: outcomes.get(op.op),
    )
    sim.run([(0, make_request("b", second, 4))])
    b = sim.requests[0]
    prefetches = [op for op in sim.ops if isinstance(op, StoreOp) and op.direction == "read"]
    assert len(prefetches) == 1
    assert b.cached_tokens == {"device": 0, "host": 0, "storage": cached}
    assert b.output_token_ids == expected_output(second, 4)
    sim.check_drained()


def preempted_sim(policy: Preemption) -> Sim:
    """Two running requests on a pool that preempts the newer one when both grow."""
    storage: dict[BlockHash, Contents] = {}
    sim = Sim(
        make_scheduler(
            device_blocks=6,
            host_blocks=16,
            host_cache=policy == "swap",
            storage=FakeStorage(storage) if policy == "save" else None,
            preemption=policy,
        ),
        storage,
    )
    sim.add(make_request("a", range(1, 12), 12))  # 11 tokens: 3 blocks, grows to 6
    sim.add(make_request("b", range(20, 31), 12))
    for _ in range(40):
        sim.one_round()
        if sim.sched.counters.preemptions[policy]:
            # save resumes at once by prefetching its blocks (then waits holding them)
            assert sim.requests[1].state in (S.PREEMPTED, S.WAITING_FOR_PREFETCH, S.WAITING)
            return sim
    raise AssertionError("no preemption")


@pytest.mark.parametrize("policy", ["recompute", "swap", "save"])
def test_an_aborted_preempted_request_frees_every_block(policy):
    sim = preempted_sim(policy)
    assert sim.sched.counters.preemptions[policy] == 1
    assert sim.sched.abort("b") is sim.requests[1]
    assert sim.requests[1].state is S.ABORTED
    sim.run()
    assert sim.requests[0].output_token_ids == expected_output(tuple(range(1, 12)), 12)
    sim.check_drained()


def test_an_aborted_waiting_request_frees_its_prefetched_blocks():
    first, second = prefix_prompts()
    storage = key_contents(first, 4)
    sim = Sim(
        make_scheduler(device_blocks=16, host_blocks=8, storage=FakeStorage(storage)), storage
    )
    sim.add(make_request("b", second, 4))
    sim.one_round()  # the prefetch, completed
    assert sim.requests[0].state is S.WAITING
    assert sim.sched.blocks.host.num_used == 4
    sim.sched.abort("b")
    sim.run()
    sim.check_drained()


def test_an_aborted_new_request_frees_nothing_and_is_forgotten():
    sim = Sim(make_scheduler())
    sim.add(make_request("a", [1, 2, 3]))
    assert sim.sched.abort("a") is sim.requests[0]
    assert sim.sched.abort("a") is None
    assert sim.sched.idle
    sim.run()
    assert sim.ops == []
    sim.check_drained()


def test_an_aborted_prefetching_request_frees_its_blocks_and_ignores_the_completion():
    first, second = prefix_prompts()
    storage = key_contents(first, 4)
    sim = Sim(
        make_scheduler(device_blocks=16, host_blocks=8, storage=FakeStorage(storage)),
        storage,
        completion_delay=5,
    )
    sim.add(make_request("b", second, 4))
    sim.one_round()
    assert sim.requests[0].state is S.WAITING_FOR_PREFETCH
    sim.sched.abort("b")
    assert sim.sched.blocks.host.num_used == 0
    sim.add(make_request("c", second, 4))  # the same keys, prefetched into the freed blocks
    sim.run()
    assert sim.requests[1].output_token_ids == expected_output(second, 4)
    sim.check_drained()


def test_an_aborted_running_request_frees_its_blocks_even_with_its_step_in_flight():
    sim = Sim(make_scheduler(device_blocks=16))
    sim.add(make_request("a", range(1, 10), 6))
    sim.add(make_request("b", range(1, 14), 6))
    sim.one_round()
    sim.issue()
    sim.sched.abort("a")
    emitted, failed = sim.sched.on_step(sim.steps[-1][0].step, "ok", sim.step_outputs)
    sim.step_outputs, sim.step_in_flight = [], None
    assert [e.request.request_id for e in emitted] == ["b"] and failed == []
    sim.run()
    assert sim.requests[1].output_token_ids == expected_output(tuple(range(1, 14)), 6)
    sim.check_drained()


def test_the_host_hits_of_an_admission_are_released_after_their_swap_in():
    first, second = prefix_prompts()
    sim = Sim(make_scheduler(device_blocks=8, host_blocks=16, host_cache=True))
    sim.run([(0, make_request("a", first, 4))])
    sim.run([(sim.round, make_request("filler", range(30, 58), 4))])  # evicts a's to host
    sim.add(make_request("b", second, 4))
    swap_in = [op for op in sim.one_round() if isinstance(op, SwapOp) and op.direction == "in"]
    assert swap_in and swap_in[0].reason == "admit"
    sim.run()
    assert sim.sched.blocks.host.num_used == 0


def test_a_step_waits_for_the_swap_in_that_fills_its_blocks():
    first, second = prefix_prompts()
    sim = Sim(make_scheduler(device_blocks=8, host_blocks=16, host_cache=True))
    sim.run([(0, make_request("a", first, 4))])
    sim.run([(sim.round, make_request("filler", range(30, 58), 4))])
    sim.add(make_request("b", second, 4))
    ops = sim.one_round()
    swap_in, step = ops[-2], ops[-1]
    assert isinstance(swap_in, SwapOp) and swap_in.direction == "in"
    assert isinstance(step, StepOp)
    assert set(swap_in.device_blocks) <= set(step.pieces[0].block_table)
    assert step.fence.swap >= swap_in.op


def test_every_fence_names_only_earlier_ops_in_a_busy_run():
    # Sim.check_fence checks each op against an independent record; this is the busiest run.
    sim, _ = run_workload(
        3,
        preemption="swap",
        host_blocks=12,
        host_cache=True,
        with_storage=True,
        device_eviction="write_through",
        poison_freed=True,
        **SMALL,
    )
    lanes = {type(op) for op in sim.ops}
    assert lanes == {StepOp, SwapOp, StoreOp}
    assert any(op.fence.swap for op in sim.ops if isinstance(op, StepOp))
    assert any(op.fence.step for op in sim.ops if isinstance(op, SwapOp))


def test_add_rejects_a_request_longer_than_the_model_or_the_device_pool():
    sched = make_scheduler(device_blocks=4, max_model_len=20)
    with pytest.raises(
        RequestError,
        match=r"'long': prompt \(15 tokens\) plus max_tokens \(6\) is 21 tokens, more than "
        r"max_model_len 20 \(sched.max_model_len",
    ):
        sched.add(make_request("long", range(15), max_tokens=6))
    assert make_scheduler(max_model_len=20).add(make_request("at", range(15), max_tokens=5)) == 0
    sched = make_scheduler(device_blocks=4)
    with pytest.raises(RequestError, match="device pool has 4"):
        sched.add(make_request("big", range(15), max_tokens=2))  # 17 tokens: 5 blocks
    assert sched.add(make_request("fits", range(15), max_tokens=1)) == 0
    with pytest.raises(RequestError, match="already live"):
        sched.add(make_request("fits", range(3)))
    assert sched.num_live == 1


def test_add_rejects_a_prompt_token_outside_the_vocabulary_and_nothing_else():
    sched = make_scheduler(vocab_size=50)  # (a Request refuses negative ids itself)
    for bad in (50, 7000):
        with pytest.raises(RequestError, match=f"prompt token {bad} is outside .* of 50") as e:
            sched.add(make_request(f"bad{bad}", (1, bad, 2)))
        assert e.value.field == "prompt_token_ids"
    assert sched.num_live == 0
    assert sched.add(make_request("ok", (0, 49))) == 0


class SwapInDropper(Sim):
    """A broken executor: swap-ins copy nothing."""

    def execute(self, op: Op) -> None:
        if isinstance(op, SwapOp) and op.direction == "in":
            self.pending.append(Pending(self.round, op, "ok", ()))
            return
        super().execute(op)


def test_the_kv_oracle_catches_a_swap_in_that_never_copied():
    first, second = prefix_prompts()
    sim = SwapInDropper(make_scheduler(device_blocks=8, host_blocks=16, host_cache=True))
    sim.run([(0, make_request("a", first, 4))])
    sim.run([(sim.round, make_request("filler", range(30, 58), 4))])
    sim.add(make_request("b", second, 4))
    with pytest.raises(OracleError, match="b reads position 0"):
        sim.one_round()


# Failed ops: what they were writing is spoiled (NaN, here SPOILED), and the spoil travels.

SPOILED = (-1,)  # the contents of a slot a failed op spoiled: NaN in the real KV


class FaultySim(Sim):
    """Executors that fail the way the Worker and the Transfer lanes do: a failing
    step or swap fills what it was writing with NaN (SPOILED) and reports failed; a copy
    carries NaN along; a step that reads NaN gets non-finite logits and fails (spoiling
    what it wrote); a write-back of a block holding NaN fails and stores nothing."""

    def __init__(self, *args: Any, fail_steps: Iterable[int] = (), fail_swaps: Iterable[int] = (),
                 **kwargs: Any) -> None:  # fmt: skip
        super().__init__(*args, **kwargs)
        self.fail_steps, self.fail_swaps = set(fail_steps), set(fail_swaps)
        self.step_status = "ok"
        self.refused_writes = 0

    def spoiled(self, contents: Contents) -> bool:
        return SPOILED in contents.values()

    def execute(self, op: Op) -> None:
        if isinstance(op, SwapOp) and op.op in self.fail_swaps:
            target = self.host if op.direction == "out" else self.device
            for b in op.host_blocks if op.direction == "out" else op.device_blocks:
                target[b] = dict.fromkeys(range(self.bs), SPOILED)
            self.pending.append(Pending(self.round + self.completion_delay, op, "failed", ()))
            return
        super().execute(op)

    def execute_store(self, op: StoreOp) -> None:
        if op.direction == "write" and any(
            self.spoiled(self.host.get(h, {})) for h in op.host_blocks
        ):
            self.refused_writes += 1  # SpoiledBlock: nothing stored
            self.pending.append(Pending(self.round + self.completion_delay, op, "failed", ()))
            return
        super().execute_store(op)

    def execute_step(self, op: StepOp) -> None:
        bs = self.bs
        reads_spoil = any(
            self.device.get(p.block_table[pos // bs], {}).get(pos % bs) == SPOILED
            for p in op.pieces
            for pos in range(p.start)
        )
        if not (reads_spoil or op.step in self.fail_steps):
            self.step_status = "ok"
            super().execute_step(op)
            return
        self.step_status = "failed"
        for b in op.poison:
            self.device[b] = {}
        for p in op.pieces:
            for pos in range(p.start, p.start + len(p.token_ids)):
                self.device.setdefault(p.block_table[pos // bs], {})[pos % bs] = SPOILED

    def apply_step(self) -> None:
        step = self.step_in_flight
        if step is not None:
            self.step_in_flight = None
            outputs, self.step_outputs = self.step_outputs, []
            self.sched.on_step(step.step, self.step_status, outputs)


FAULT_CASES = [c for c in TIER_CASES if "host-storage-write_through" in str(c.id) or
               str(c.id) in ("swap-host", "recompute-staging-storage-write-through")]  # fmt: skip


@pytest.mark.parametrize("delay", [0, 2])
@pytest.mark.parametrize("config", FAULT_CASES)
def test_failed_steps_and_swaps_spoil_what_they_wrote_and_every_request_still_gets_its_outputs(
    config, delay, reference_outputs
):
    sim = small_sim(
        config,
        FaultySim,
        completion_delay=delay,
        fail_steps={3, 9, 17, 30},
        fail_swaps={2, 5, 8, 13},
    )
    assert isinstance(sim, FaultySim)
    arrivals = make_workload(3)
    sim.run(arrivals)
    assert {r.request_id: r.output_token_ids for _, r in arrivals} == reference_outputs[3]
    counters = sim.sched.counters
    assert counters.retries >= len(sim.fail_steps), counters
    assert not any(sim.spoiled(blob) for blob in sim.storage.values())
    sim.check_drained()


def test_a_request_whose_steps_keep_failing_is_aborted_after_its_retries():
    sim = FaultySim(make_scheduler(device_blocks=16), fail_steps=range(1, 100))
    sim.add(make_request("a", range(1, 9), max_tokens=4))
    for _ in range(STEP_RETRIES):
        sim.one_round()
        assert sim.requests[0].state is S.PREEMPTED  # back to waiting, computed again
    sim.one_round()
    assert sim.requests[0].state is S.ABORTED and sim.requests[0].num_output_tokens == 0
    assert sim.sched.counters.retries == STEP_RETRIES
    sim.check_drained()

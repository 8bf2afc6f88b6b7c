"""``bench route``'s workload replayed in virtual time: the router's :class:`Picker` choosing
among simulated engines (``actors/tools/bench/serving/sim_engine.py``) stepped on one clock,
with no HTTP and no process, so that a policy's figures are exact and the same on every run.

The router's accounting is what ``router/forward.py`` and ``router/state.py`` keep: a
request counts as sent and in flight from its choice to its last token (``Picker.sent`` to
``Picker.ended``), as not begun until its first token (``Instance.ahead_blocks``); each
instance's word (``GET /ringfence/load``) is fresh at every change, and its KV events reach
the index when they are published (evictions as a step is scheduled, new blocks as it ends).
"""

from __future__ import annotations

from dataclasses import dataclass

from ringfence.actors.engine.percentiles import percentile
from ringfence.actors.router.instances import Identity, Instance
from ringfence.actors.router.policy import Choice, Picker
from ringfence.actors.tools.bench.serving import route
from ringfence.actors.tools.bench.serving.client import LoadRequest
from ringfence.actors.tools.bench.serving.instance_api import BLOCK_SIZE, NAMESPACE
from ringfence.actors.tools.bench.serving.sim_engine import CostModel, SimEngine, Step
from ringfence.cache.block_hash import block_keys
from ringfence.cache.ids import BlockHash
from ringfence.cache.kv_index import KVIndex

IDENT = Identity(role="both", model="sim", fingerprints=("sim",), namespace=NAMESPACE.hex(),
                 block_size=BLOCK_SIZE)  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class Replayed:
    """One policy's run: TTFT p90 (seconds), prompt tokens computed, requests per instance."""

    ttft_p90_s: float
    computed_tokens: int
    per_instance: tuple[int, ...]


class Replay:
    """One policy over simulated engines, event by event in time order."""

    def __init__(self, policy: str, instances: int, model: CostModel) -> None:
        self.pool = [Instance(f"i{n}", "both", IDENT) for n in range(instances)]
        self.index = KVIndex()
        self.picker = Picker(policy, self.pool, self.index)
        self.model = model
        self.engines = [SimEngine(model) for _ in self.pool]
        self.steps: list[tuple[float, Step] | None] = [None] * instances  # each one's, its end
        # Each request by (instance, its id there): when it was sent, the choice, its keys.
        self.sent: dict[tuple[int, int], tuple[float, Choice, list[BlockHash]]] = {}
        self.ttft: list[float] = []
        self.computed = 0
        for n in range(instances):
            self.word(n)

    def word(self, n: int) -> None:
        """Instance ``n``'s load, as the router reads it when it changed."""
        instance = self.pool[n]
        instance.load = self.engines[n].load()
        instance.in_flight_at_load = instance.in_flight
        instance.unstarted_at_load = instance.unstarted

    def arrive(self, request: LoadRequest) -> None:
        keys = block_keys(request.prompt_token_ids, BLOCK_SIZE, namespace=NAMESPACE)
        choice = self.picker.choose(keys)
        assert choice is not None
        self.picker.sent(choice, keys)
        self.picker.routed(choice, keys)
        instance = choice.instance
        instance.in_flight += 1
        instance.unstarted += 1
        instance.ahead_blocks += choice.need
        n = self.pool.index(instance)
        sim = self.engines[n].add(request.prompt_token_ids, request.max_tokens)
        self.sent[n, sim.id] = (request.arrival_s, choice, keys)
        self.word(n)

    def end_step(self, now: float, n: int) -> None:
        ending = self.steps[n]
        assert ending is not None
        self.steps[n] = None
        done = self.engines[n].finish(ending[1])
        self.index.apply_all(self.pool[n].url, list(ending[1].stored))
        instance = self.pool[n]
        for sim in done.tokens:
            at, choice, keys = self.sent[n, sim.id]
            if len(sim.output) == 1:  # its first token: its prefill is no longer ahead
                self.ttft.append(now - at)
                self.computed += len(sim.prompt) - sim.cached_tokens
                instance.unstarted -= 1
                instance.ahead_blocks = max(instance.ahead_blocks - choice.need, 0.0)
            if sim.done:
                instance.in_flight -= 1
                self.picker.ended(choice, keys)
        self.word(n)

    def start_steps(self, now: float) -> None:
        """A step on every idle engine with work."""
        for n, engine in enumerate(self.engines):
            if self.steps[n] is None and engine.has_work:
                step = engine.schedule()
                self.index.apply_all(self.pool[n].url, list(step.removed))
                self.steps[n] = (now + self.model.step_s(step.prefill_tokens, len(step.decode)),
                                 step)  # fmt: skip
                self.word(n)

    def run(self, requests: list[LoadRequest]) -> Replayed:
        arrived = 0
        while arrived < len(requests) or any(self.steps):
            ends = [(step[0], n) for n, step in enumerate(self.steps) if step is not None]
            if arrived < len(requests) and (
                not ends or requests[arrived].arrival_s <= min(ends)[0]
            ):
                now = requests[arrived].arrival_s
                self.arrive(requests[arrived])
                arrived += 1
            else:
                now, n = min(ends)
                self.end_step(now, n)
            self.start_steps(now)
        counts = [n for n, _ in self.sent]
        return Replayed(
            ttft_p90_s=percentile(self.ttft, 90),
            computed_tokens=self.computed,
            per_instance=tuple(counts.count(n) for n in range(len(self.pool))),
        )


def replay(
    case: str, policy: str, *, seed: int = 0, instances: int = 3,
    model: CostModel = route.SIM_MODEL,
) -> Replayed:  # fmt: skip
    """``case``'s workload (16 tokens a turn) at its sim rate through ``policy``."""
    shape = {k: int(route.CASES[case][k]) for k in ("groups", "users", "turns", "system_blocks")}
    requests = route.shared_prefix_requests(
        **shape, max_tokens=16, rate=route.CASES[case]["sim_rate"], seed=seed
    )
    return Replay(policy, instances, model).run(requests)

"""The simulated instance's engine: continuous batching as vLLM's v1 scheduler does it, over
a device pool with a prefix cache, and a modelled time per step. Pure and clock-free: the
caller (``sim_instance.py``) sleeps each step's :meth:`CostModel.step_s` between
:meth:`SimEngine.schedule` and :meth:`SimEngine.finish`, one step at a time.

A step, as :meth:`SimEngine.schedule` builds it:

1. every running request, in admission order: one token if it is decoding, else the next
   chunk of its prompt (its uncached tokens, at most what the token budget has left);
2. then the waiting requests, first come first served: the head is admitted while fewer
   than ``max_num_seqs`` run, the budget has a token left and the pool has the blocks it
   needs (its prompt's and its output's, all taken at admission, so a running request never
   waits for a block); the first that cannot be admitted stops admission (no overtaking).

A request's cache hit is the longest cached prefix of its prompt's full blocks, at most its
prompt less one token (as vLLM: the last token is computed for its logits). The hit costs
nothing; only the prompt tokens after it are prefilled, ``max_batched_tokens`` a step at
most across the batch (chunked prefill). A full block becomes findable as soon as the step
that computes it is scheduled (vLLM's v1 caches blocks at allocation), and is published
(``BlockStored``) when that step ends. A request that finished its prompt gets its first
token at the end of that step, then one a step.
"""

from __future__ import annotations

import hashlib
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Final

from ringfence.actors.http.load import Load
from ringfence.actors.tools.bench.serving.instance_api import BLOCK_SIZE, NAMESPACE
from ringfence.actors.tools.bench.serving.sim_blocks import BlockPool
from ringfence.cache.block_hash import block_keys
from ringfence.cache.ids import BlockHash
from ringfence.cache.kv_events import BlockRemoved, BlockStored

MEDIUM: Final = "GPU"  # the only tier it has
VOCAB: Final = 32_000  # output token ids are drawn from 1..VOCAB


class PoolExhausted(ValueError):
    """A prompt needs more blocks than the whole pool has (it could never run)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """How long a step takes and how much the engine can hold.

    The defaults are a chosen scale of the order of a 1B-class model served by vLLM on one
    modern data-centre GPU, not a measurement: a decode step of a small batch costs a few
    milliseconds of fixed work (kernel launches, the sampler), a prompt token of the order
    of 0.01-0.05 ms of prefill (20 000 tokens a second at 0.05, the slow end), and each
    decoding sequence a little attention and sampling. ``max_batched_tokens`` and
    ``max_num_seqs`` are vLLM's usual chunked-prefill budget and sequence cap; 4096 blocks
    of 16 tokens hold 64k tokens (far fewer than such a GPU holds: enough that a benchmark's
    working set fits unless ``blocks`` is lowered)."""

    step_ms: float = 4.0  # every step's fixed cost
    prefill_ms_per_token: float = 0.05  # each prompt token computed in the step
    decode_ms_per_seq: float = 0.05  # each sequence decoding in the step
    blocks: int = 4096  # device blocks of BLOCK_SIZE tokens
    max_batched_tokens: int = 2048  # tokens a step computes at most (prefill and decode)
    max_num_seqs: int = 256  # requests running at most

    def __post_init__(self) -> None:
        for key in ("step_ms", "prefill_ms_per_token", "decode_ms_per_seq"):
            if not getattr(self, key) >= 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)!r}")
        for key in ("blocks", "max_batched_tokens", "max_num_seqs"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)!r}")

    def step_s(self, prefill_tokens: int, decoding: int) -> float:
        """Seconds a step of ``prefill_tokens`` prompt tokens and ``decoding`` sequences takes."""
        ms = self.step_ms + self.prefill_ms_per_token * prefill_tokens
        return (ms + self.decode_ms_per_seq * decoding) / 1000.0

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


@dataclass(slots=True, kw_only=True)
class SimRequest:
    """One request in the engine. Mutated by its :class:`SimEngine` only."""

    id: int
    prompt: tuple[int, ...]
    max_tokens: int
    keys: tuple[BlockHash, ...] = ()  # its prompt's full blocks' keys (set on add)
    cached_tokens: int = 0  # prompt tokens its cache hit gave it (set on admission)
    computed: int = 0  # prompt tokens with KV: the hit, then each step's chunk
    output: list[int] = field(default_factory=list)  # its tokens so far
    held: list[BlockHash] = field(default_factory=list)  # the cached blocks it holds
    unnamed: int = 0  # the other blocks it holds
    aborted: bool = False

    @property
    def blocks_needed(self) -> int:
        return math.ceil((len(self.prompt) + self.max_tokens) / BLOCK_SIZE)

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_tokens

    def token_at(self, position: int) -> int:
        """Its output token at ``position``: a function of the prompt and the position
        alone, so every instance gives a prompt the same tokens."""
        seed = hashlib.blake2b(repr((self.prompt, position)).encode(), digest_size=8)
        return int.from_bytes(seed.digest(), "big") % VOCAB + 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Step:
    """One scheduled step: what it computes, and the blocks its admissions evicted."""

    prefill: tuple[tuple[SimRequest, int], ...]  # each request and its prompt tokens
    decode: tuple[SimRequest, ...]  # each decoding request (one token each)
    removed: tuple[BlockRemoved, ...]  # evicted for the admissions (published at once)
    stored: tuple[BlockStored, ...]  # the full blocks it computes (published at its end)

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDone:
    """What a step gave: a token to each request in ``tokens`` (its last, in
    ``request.output``), and the requests it finished (their blocks released)."""

    tokens: tuple[SimRequest, ...]
    finished: tuple[SimRequest, ...]


class SimEngine:
    """The engine (see the module docstring). Used by one thread (the instance's loop)."""

    def __init__(self, model: CostModel) -> None:
        self.model = model
        self.pool = BlockPool(model.blocks)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self._next_id = 0

    def add(self, prompt: Sequence[int], max_tokens: int) -> SimRequest:
        """Queue a request (last in the waiting queue); PoolExhausted if it could never
        fit, ValueError for an empty prompt or ``max_tokens`` below 1."""
        if not prompt or max_tokens < 1:
            raise ValueError("a request needs a prompt and max_tokens >= 1")
        request = SimRequest(id=self._next_id, prompt=tuple(prompt), max_tokens=max_tokens)
        if request.blocks_needed > self.pool.num_blocks:
            raise PoolExhausted(
                f"the prompt and its output need {request.blocks_needed} blocks; "
                f"the pool has {self.pool.num_blocks} (--blocks)"
            )
        request.keys = tuple(block_keys(request.prompt, BLOCK_SIZE, namespace=NAMESPACE))
        self._next_id += 1
        self.waiting.append(request)
        return request

    def abort(self, request: SimRequest) -> None:
        """Drop ``request`` (its client went away) and release its blocks now; a step
        scheduled with it gives it no token."""
        request.aborted = True
        if request in self.waiting:
            self.waiting.remove(request)
        elif request in self.running:
            self.running.remove(request)
            self.pool.release(request.held, request.unnamed)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def load(self) -> Load:
        """What ``GET /ringfence/load`` says: the fields a real instance gives."""
        return Load(
            pending=len(self.running) + len(self.waiting),
            running=len(self.running),
            waiting=len(self.waiting),
            free_blocks=self.pool.num_free,
            total_blocks=self.pool.num_blocks,
        )

    def schedule(self) -> Step:
        """The next step (see the module docstring): admits, allocates and advances each
        scheduled request's ``computed`` now."""
        budget = self.model.max_batched_tokens
        prefill: list[tuple[SimRequest, int]] = []
        decode: list[SimRequest] = []
        stored: list[BlockStored] = []
        for request in self.running:
            if budget < 1:
                break
            if request.computed >= len(request.prompt):
                decode.append(request)
                budget -= 1
                continue
            chunk = min(len(request.prompt) - request.computed, budget)
            budget -= chunk
            prefill.append((request, chunk))
            stored += self._compute(request, chunk)
        evicted: list[BlockHash] = []
        while self.waiting and budget >= 1 and len(self.running) < self.model.max_num_seqs:
            request = self.waiting[0]
            hit_cap = (len(request.prompt) - 1) // BLOCK_SIZE  # the last token is computed
            hits = request.keys[: self.pool.cached_prefix(request.keys[:hit_cap])]
            new = request.blocks_needed - len(hits)
            if new > self.pool.num_free - self.pool.free_among(hits):
                break  # first come, first served: nothing overtakes the head
            self.waiting.popleft()
            self.pool.hold(hits)
            evicted += self.pool.allocate(new)
            request.held, request.unnamed = list(hits), new
            request.computed = request.cached_tokens = len(hits) * BLOCK_SIZE
            self.running.append(request)
            chunk = min(len(request.prompt) - request.computed, budget)
            budget -= chunk
            prefill.append((request, chunk))
            stored += self._compute(request, chunk)
        removed = (BlockRemoved(keys=tuple(evicted), medium=MEDIUM),) if evicted else ()
        return Step(prefill=tuple(prefill), decode=tuple(decode), removed=removed,
                    stored=tuple(stored))  # fmt: skip

    def _compute(self, request: SimRequest, chunk: int) -> list[BlockStored]:
        """Advance ``request`` by ``chunk`` prompt tokens; cache the full blocks that
        completes (unless cached already): their events, one per chain of new blocks."""
        first = request.computed // BLOCK_SIZE
        request.computed += chunk
        last = min(request.computed // BLOCK_SIZE, len(request.keys))
        events: list[BlockStored] = []
        run: list[int] = []  # block indices of the chain being built
        for n in range(first, last):
            if self.pool.cache(request.keys[n]):
                request.held.append(request.keys[n])
                request.unnamed -= 1
                run.append(n)
                continue
            events += self._stored(request, run)
            run = []
        return events + self._stored(request, run)

    @staticmethod
    def _stored(request: SimRequest, run: list[int]) -> list[BlockStored]:
        if not run:
            return []
        start, end = run[0], run[-1] + 1
        return [BlockStored(
            keys=request.keys[start:end], parent=request.keys[start - 1] if start else None,
            token_ids=request.prompt[start * BLOCK_SIZE : end * BLOCK_SIZE],
            block_size=BLOCK_SIZE, medium=MEDIUM,
        )]  # fmt: skip

    def finish(self, step: Step) -> StepDone:
        """End ``step``: a token to each request that finished its prompt in it and to each
        decoding one; the requests done leave, their blocks released (cached ones stay
        findable until evicted)."""
        tokens: list[SimRequest] = []
        finished: list[SimRequest] = []
        sampled = [r for r, _ in step.prefill if r.computed >= len(r.prompt)]
        for request in [*sampled, *step.decode]:
            if request.aborted:
                continue
            request.output.append(request.token_at(len(request.output)))
            tokens.append(request)
            if request.done:
                finished.append(request)
                self.running.remove(request)
                self.pool.release(request.held, request.unnamed)
        return StepDone(tokens=tuple(tokens), finished=tuple(finished))

"""Which aggregated instance gets a request: ``--policy round_robin | least_loaded |
approximate | cache``.

- ``round_robin``: each instance in turn.
- ``least_loaded``: the least load (below; ties in turn).
- ``approximate``: no events; the router remembers where it sent each prompt's blocks
  (the SGLang router's and the inference gateway's method) and scores instances as
  ``cache`` does, as if every block it sent there were still on the device. The baseline
  ``cache`` must beat.
- ``cache``: the index of every instance's KV events (``cache/kv_index.py``): what each
  one really holds, and on which medium; and the prompts this router has in flight there,
  which it holds or is computing before any event says so (below).

The cost function (the lowest cost wins; ties go to the most cached, then the least load,
then in turn), after
Dynamo's KV router (``overlap_weight * prefill_blocks + decode_blocks``)::

    cost(i) = overlap_weight * need(i) + load(i) + short(i)
    need(i) = P - cached(i)
    load(i) = mean_need * (in_flight(i) + others(i))
    others(i) = max(running(i) + waiting(i) - in_flight_then(i), 0)
    short(i) = max(need(i) - free(i), 0)

with ``P`` the prompt's full blocks; ``cached(i)`` the blocks of the instance's longest
cached prefix of them, each weighted by where it is best found: ``device_weight`` (1.0: no
work), ``host_weight`` (0.8: a swap-in) and ``storage_weight`` (0.5: a prefetch, then a
swap-in), so ``need(i)`` is the prefill work it still needs, in blocks. Under ``cache`` it
is the larger of what the index says and ``device_weight`` times the longest prefix of the
prompt among the prompts of this router's requests in flight there, from the moment each is
sent until it ends (``flying(i)``; over prefill and decode instances, ``flow.py``: on a
decode instance from the reserve call to the end of the answer, on a prefill instance until
its prefill ends): an instance publishes a block once the step that computed it ended, and
under load that is seconds after the router sent the prompt; meanwhile the blocks are on
its device or being computed, held by the running request (never evicted), and an engine
that caches blocks as it allocates them (vLLM) gives them to the next prompt that shares
them. Without this, a burst behind one new prefix, or a conversation's next turn sent
before its last one began, is scored as a miss everywhere and spread by load alone, and
each instance it reaches computes the prefix again. ``load(i)`` is the work the requests
there put before a new one,
in the same unit: ``mean_need``, the mean prefill the routed requests needed where they went
(in blocks, at least 1), times the requests there. An engine batches continuously: a
request there costs the next one's first token the prefill it needs, while its decode runs
in the same steps as the next one's at a small cost a step; counted at its whole prompt, a
few requests decoding on the instance that holds a prefix would outweigh a whole miss and
send the prompt to recompute it elsewhere. The requests are counted from two sources:

- ``in_flight(i)``, the router's own requests in flight there: exact and immediate;
- ``others(i)``, the requests of other clients there, from the instance's own word
  (``GET /ringfence/load``, followed as a long poll, as fresh as the engine's last tick):
  its requests running and waiting less the router's own in flight when that word came
  (``in_flight_then``). A word a tick old still counts requests of this router that have
  ended since; subtracting the count of that moment keeps them from counting twice.

``short(i)``: the blocks the prompt needs beyond the device blocks free there (cached ones
count as free: they can be taken), which it must wait for or preempt; 0 without the
instance's word. Blocks in use are not load by themselves: a hot prefix shared by every
request there is held once, and costs the next request nothing.

A hot prefix held by one instance draws requests there only until its queue costs more
than recomputing the prefix elsewhere. The queue that delays a first token is the prefill
ahead of it, so the choice then spills (:meth:`Picker.spill`) where the prefill to do before
this prompt's first token is least, once the chosen instance's is more than another's::

    ahead(i) = the need of the router's requests there not begun (no first byte yet)
               + max(waiting(i) - unstarted_then(i), 0) * mean_need
    spill to j when ahead(best) > 0 and ahead(best) + need(best) > ahead(j) + need(j)
                and (ahead(j) = 0 or need(j) <= need(best))

(``j`` the least ``ahead(j) + need(j)`` of the instances that may take it), that is, when
the prefill queued ahead on the holder costs more than its hit saves (the prompt's need
elsewhere less its need there), to an instance with no prefill queued or one that holds as
much of the prompt. ``mean_need`` is the mean prefill the routed requests
needed where they went; the other clients' waiting requests are counted at it. A request
answered whole (not streamed) counts as not begun until its answer came. A spill that
recomputes the prefix where prefill is queued only moves the queue: the recomputation delays
every request queued behind it there, and when every instance is busy (saturation) the total
work decides the throughput; an idle instance's capacity is free.

The keys are the engine's (``cache/block_hash.py``, namespaced by the instances' shared
fingerprint). Owned by the router's event loop.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from ringfence.actors.router.instances import Instance
from ringfence.cache.ids import BlockHash
from ringfence.cache.kv_events import BlockRemoved, BlockStored
from ringfence.cache.kv_index import KVIndex, Overlap

POLICIES: Final = ("round_robin", "least_loaded", "approximate", "cache")
# A missed block costs its prefill to this request and, as work added, to those after it;
# a request there costs the next one its mean need (the load term). On `bench route`'s
# workload TTFT p90 fell from 412 ms at weight 1 to 255 at 2 and 197-302 at 4, and rose
# again at 8 (RESULTS.md; measured when the load term counted the mean prompt).
DEFAULT_OVERLAP_WEIGHT: Final = 4.0
APPROXIMATE_BLOCKS: Final = 1 << 20  # blocks the approximate policy remembers, LRU


@dataclass(frozen=True, slots=True, kw_only=True)
class Weights:
    """The cost function's weights (see the module docstring)."""

    overlap: float = DEFAULT_OVERLAP_WEIGHT
    device: float = 1.0
    host: float = 0.8
    storage: float = 0.5

    def cached(self, overlap: Overlap) -> float:
        on = overlap.on
        return (
            self.device * on.get("GPU", 0)
            + self.host * on.get("CPU", 0)
            + self.storage * on.get("STORAGE", 0)
        )


@dataclass(frozen=True, slots=True)
class Choice:
    """The instance chosen, and the weighted blocks of the prompt it holds."""

    instance: Instance
    cached: float = 0.0
    prompt_blocks: int = 0
    spilled: bool = False  # the cost function's choice had more prefill queued (spill)

    @property
    def need(self) -> float:
        """The prefill the prompt needs there, in blocks."""
        return max(self.prompt_blocks - self.cached, 0.0)


class Picker:
    """One router's policy over its instances (see the module docstring)."""

    def __init__(
        self,
        policy: str,
        instances: Sequence[Instance],
        index: KVIndex | None,
        weights: Weights = Weights(),
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}: got {policy!r}")
        self.policy = policy
        self.instances = list(instances)
        self.weights = weights
        self.index = index if policy == "cache" else KVIndex() if policy == "approximate" else None
        self._cursor = 0
        self._sent: OrderedDict[BlockHash, str] = OrderedDict()  # approximate: LRU of keys
        # cache: the keys of the prompts in flight on each instance (by URL), with how many
        # of those prompts hold each (flying(i) in the module docstring).
        self._flying: dict[str, Counter[BlockHash]] = {}
        self._blocks_routed = 0
        self._need_routed = 0.0
        self._routed = 0
        self.down: set[str] = set()  # instances routed around (found dead)

    @property
    def needs_keys(self) -> bool:
        return self.index is not None

    def mean_blocks(self) -> float:
        """The mean prompt the router routed (blocks, >= 1)."""
        return max(self._blocks_routed / self._routed, 1.0) if self._routed else 1.0

    def load(self, instance: Instance) -> float:
        """The work the requests on ``instance`` put before a new one, in blocks: each at
        the mean need (see the module docstring)."""
        word, own = instance.load, instance.in_flight
        others = 0 if word is None else word.running + word.waiting - instance.in_flight_at_load
        return (own + max(others, 0)) * self.mean_need()

    def mean_need(self) -> float:
        """The mean prefill the routed requests needed where they went (blocks, >= 1)."""
        return max(self._need_routed / self._routed, 1.0) if self._routed else 1.0

    def ahead(self, instance: Instance) -> float:
        """The prefill queued on ``instance`` before a new prompt's, in blocks (see the
        module docstring): this router's requests not begun, exactly, and the other
        clients' waiting ones at the mean need."""
        word = instance.load
        others = 0 if word is None else max(word.waiting - instance.unstarted_at_load, 0)
        return instance.ahead_blocks + others * self.mean_need()

    @staticmethod
    def short(instance: Instance, need: float) -> float:
        """The blocks ``need`` asks beyond those free on ``instance`` (0 without its word)."""
        word = instance.load
        return 0.0 if word is None else max(need - word.free_blocks, 0.0)

    def choose(self, keys: Sequence[BlockHash] = ()) -> Choice | None:
        """The instance for a prompt of ``keys`` (None when every instance is down)."""
        ring = [self.instances[(self._cursor + k) % len(self.instances)]
                for k in range(len(self.instances))]  # fmt: skip
        ring = [i for i in ring if i.url not in self.down]
        if not ring:
            return None
        if self.policy == "round_robin":
            choice = Choice(ring[0])
        elif self.policy == "least_loaded" or self.index is None or not keys:
            choice = Choice(min(ring, key=self.load), prompt_blocks=len(keys))
        else:
            found = self.index.overlap(keys)
            w = self.weights
            costs = []
            for instance in ring:
                cached = max(
                    w.cached(found.get(instance.url, Overlap(0))),
                    w.device * self.flying(instance, keys),
                )
                need, load = len(keys) - cached, self.load(instance)
                cost = w.overlap * need + load + self.short(instance, need)
                costs.append((cost, load, cached, instance))
            _, _, cached, best = min(costs, key=lambda c: (c[0], -c[2], c[1]))
            choice = self.spill(Choice(best, cached, len(keys)), [(c[3], c[2]) for c in costs])
        self._cursor = (self.instances.index(choice.instance) + 1) % len(self.instances)
        return choice

    def flying(self, instance: Instance, keys: Sequence[BlockHash]) -> int:
        """The longest prefix of ``keys`` among the prompts of this router's requests in
        flight on ``instance`` (0 but under ``cache``). Keys chain, so a key held means its
        whole prefix is."""
        held = self._flying.get(instance.url)
        if not held:
            return 0
        return next((n for n, key in enumerate(keys) if key not in held), len(keys))

    def spill(self, choice: Choice, held: Sequence[tuple[Instance, float]]) -> Choice:
        """``choice``, or where the prefill to do before the prompt's first token is least
        when ``choice.instance`` has prefill queued and more to do, among the instances
        with no prefill queued and those that need no more of the prompt (the module
        docstring); ``held``: each instance and the weighted blocks of the prompt it holds."""
        ahead = self.ahead(choice.instance)
        if ahead <= 0:
            return choice
        queued = {i: self.ahead(i) for i, _ in held}
        need = {i: max(choice.prompt_blocks - c, 0.0) for i, c in held}
        todo = {i: queued[i] + need[i] for i, _ in held}
        may = [h for h in held if queued[h[0]] <= 0 or need[h[0]] <= choice.need]
        if not may:
            return choice
        least, cached = min(may, key=lambda h: (todo[h[0]], -h[1]))
        if todo[least] >= todo[choice.instance]:
            return choice
        return Choice(least, cached, choice.prompt_blocks, spilled=True)

    def routed(self, choice: Choice, keys: Sequence[BlockHash]) -> None:
        """A request of ``keys`` was sent to ``choice.instance`` (``approximate`` remembers)."""
        self._routed += 1
        self._blocks_routed += len(keys)
        self._need_routed += choice.need
        if self.policy != "approximate" or not keys or self.index is None:
            return
        name = choice.instance.url
        for key in keys:
            before = self._sent.pop(key, None)
            if before is not None and before != name:
                self.index.apply(before, BlockRemoved(keys=(key,), medium="GPU"))
            self._sent[key] = name
        self.index.apply(name, _stored(keys))
        while len(self._sent) > APPROXIMATE_BLOCKS:
            key, owner = self._sent.popitem(last=False)
            self.index.apply(owner, BlockRemoved(keys=(key,), medium="GPU"))

    def sent(self, choice: Choice, keys: Sequence[BlockHash]) -> None:
        """A request of ``keys`` is being sent to ``choice.instance``: under ``cache`` its
        prompt counts as in flight there (``flying(i)``) until :meth:`ended`."""
        if self.policy == "cache" and keys:
            self._flying.setdefault(choice.instance.url, Counter()).update(keys)

    @contextmanager
    def flight(self, choice: Choice, keys: Sequence[BlockHash]) -> Iterator[Choice]:
        """:meth:`sent` for the block, :meth:`ended` however it ends (answered, failed,
        cancelled)."""
        self.sent(choice, keys)
        try:
            yield choice
        finally:
            self.ended(choice, keys)

    def ended(self, choice: Choice, keys: Sequence[BlockHash]) -> None:
        """A request :meth:`sent` with ``keys`` to ``choice.instance`` ended (answered,
        failed, abandoned, or never reached it): its prompt no longer counts as in flight
        there."""
        held = self._flying.get(choice.instance.url)
        if not held:
            return  # forgotten when the instance was marked down
        for key in keys:
            if held.get(key, 0) > 1:
                held[key] -= 1
            else:
                held.pop(key, None)

    def mark_down(self, instance: Instance) -> None:
        """Route around ``instance`` and forget what the index says it holds, and what
        this router sent it."""
        self.down.add(instance.url)
        self._flying.pop(instance.url, None)
        if self.index is not None:
            self.index.clear(instance.url)

    def mark_up(self, instance: Instance) -> None:
        self.down.discard(instance.url)


def _stored(keys: Sequence[BlockHash]) -> BlockStored:
    return BlockStored(keys=tuple(keys), parent=None, token_ids=(), block_size=1, medium="GPU")

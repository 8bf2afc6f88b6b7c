"""Preemption: room on the device for a running sequence, taken from newer ones if need be.

When a running sequence needs a block and none is free, the newest admitted running
sequence in neither this step nor a step in flight is preempted (possibly the sequence
itself), by the configured policy (``sched.preemption``):

- ``recompute``: its blocks are freed; the full ones stay cached on device until reused;
- ``swap``: its computed blocks are copied to the host tier, where it holds them, and it
  resumes by swapping them back in (recompute instead when the host tier is full);
- ``save``: its full blocks are written to storage (through staging host blocks), and it
  resumes from there by prefetch; the partial last block is recomputed (recompute
  instead when there is no room to stage them).

A request that asked for its prompt's log probabilities is always recomputed: it resumes
from its first token. A preempted sequence goes back to waiting before every later
arrival (:meth:`ringfence.sched.queues.Queues.back_to_waiting`), with nothing computed.

Owned by the :class:`ringfence.sched.scheduler.Scheduler`; mutates the sequences, the
queues, the blocks (allocations, swap-outs, saves, host holds), the journal and the
counters it is given. Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Set

from ringfence.sched.blocks import BlockManager
from ringfence.sched.config import SchedulerConfig
from ringfence.sched.pieces import PieceMaker
from ringfence.sched.queues import Queues
from ringfence.sched.request import RequestState
from ringfence.sched.sequence import Counters, Journal, Sequence, Tail


class Preemption:
    """Device blocks for running sequences, preempting newer ones by the configured policy."""

    def __init__(
        self,
        config: SchedulerConfig,
        *,
        blocks: BlockManager,
        pieces: PieceMaker,
        queues: Queues,
        journal: Journal,
        counters: Counters,
    ) -> None:
        self._policy = config.sched.preemption
        self._bs = config.tiers.block_size
        self._blocks = blocks
        self._pieces = pieces
        self._queues = queues
        self._journal = journal
        self._counters = counters

    def room(self, seq: Sequence, end: int, scheduled: Set[int], busy: Set[int]) -> bool:
        """Blocks for the sequence's positions up to ``end``, preempting the newest running
        sequence in neither ``scheduled`` (this step) nor ``busy`` (a step in flight) while
        none are free. False if there is none to preempt, or the sequence itself was."""
        need = -(-end // self._bs) - len(seq.blocks)
        while need > 0:
            new = self._blocks.allocate_device(need)
            if new is not None:
                seq.blocks.extend(new)
                break
            victim = self._queues.newest_running(sparing=scheduled | busy)
            if victim is None:
                return False
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Take running ``seq`` off the device by the policy (module doc); counted and
        journaled under the policy it got."""
        r = seq.request
        policy = self._policy
        if r.params.prompt_logprobs is not None:
            policy = "recompute"  # it resumes from its first token: see admission._start
        computed = r.num_computed_tokens
        used = -(-computed // self._bs)
        full = computed // self._bs
        keys = self._pieces.keys(seq, r.all_token_ids, full)
        if policy == "swap" and used:
            host = self._blocks.allocate_host(used)
            if host is None:
                policy = "recompute"  # no room on host: recompute instead (counted as such)
            else:
                self._blocks.swap_out(seq.blocks[:used], host, "preempt")
                # Findable at once, before the copy is done: a swap-in of them is issued
                # after this swap-out on the same lane, which runs its ops in order.
                seq.held = self._blocks.hold_on_host(host[:full], keys)
                seq.tail = None
                if used > full:
                    seq.tail = Tail(host[full], full, computed - full * self._bs)
        elif policy == "save" and full:
            saved = self._blocks.save(seq.blocks[:full], keys, "preempt")
            policy = "save" if saved else "recompute"  # no room to stage them: recompute
        self._counters.preemptions[policy] += 1
        self._journal.record("preempt", seq, policy=policy, computed=computed)
        self.requeue(seq)

    def requeue(self, seq: Sequence) -> None:
        """Take a running sequence off the device (blocks freed, nothing computed) and put
        it back in the waiting queue in arrival order."""
        self._blocks.free_device(seq.blocks)
        seq.blocks, seq.num_keyed = [], 0
        seq.opened = False  # its next piece opens it again, from wherever it resumes
        seq.sampled_by = seq.pending_in = 0  # a token of a step in flight is not applied
        seq.request.num_computed_tokens = 0
        seq.request.transition(RequestState.PREEMPTED)
        self._queues.back_to_waiting(seq)  # before every later arrival

"""The scheduler's faults: a step that failed, a copy that failed, a device tier lost.

When a step fails (it raised, or read KV that a failed copy spoiled and got non-finite
logits), what it wrote holds NaN (``actors/executors/transfer.py``), and so does every copy
made of it since: each sequence of the step loses every cached copy of its blocks, on
device and host, and goes back to waiting with its tokens so far (a ``retry`` decision).
A request whose steps failed more than ``step_retries`` times without a token between
them is aborted. A step ``rejected`` as malformed aborts its requests at once: running it
again would not help. A step in flight after the failed one is void (its result will be
dropped) and its sequences are computed again too.

A swap-out that failed filled nothing: a swap-preempted request holding any of its host
blocks gives up its host copies and is computed again instead.

When the Worker restarts, :meth:`Faults.reset_device` takes the device tier as lost:
every op in flight as failed, every running request back to waiting with its tokens so
far, to be computed again from host, storage or scratch.

Owned by the :class:`ringfence.sched.scheduler.Scheduler`, which hands it the parts of
its state a fault touches and the three moves it shares with stepping (take a sequence
off the device, abort a request, apply a transfer's completion). Not thread-safe.
"""

from __future__ import annotations

from collections.abc import Callable

from ringfence.cache.fences import Lane
from ringfence.cache.ids import BlockId
from ringfence.sched.admission import Admission
from ringfence.sched.blocks import BlockManager
from ringfence.sched.in_flight import StepsInFlight
from ringfence.sched.ops import StepOp
from ringfence.sched.queues import Queues
from ringfence.sched.request import Request, RequestState
from ringfence.sched.sequence import Counters, Journal, Sequence


class Faults:
    """What the scheduler does on a failed step, a failed swap-out and a lost device tier.

    Mutates the queues, the blocks, the steps in flight, the admission's prefetches, the
    journal and the counters it is given, directly or through ``requeue``, ``abort`` and
    ``cancel``.
    """

    def __init__(
        self,
        *,
        queues: Queues,
        blocks: BlockManager,
        admission: Admission,
        in_flight: StepsInFlight,
        journal: Journal,
        counters: Counters,
        requeue: Callable[[Sequence], None],
        abort: Callable[[str], Request | None],
        cancel: Callable[[Lane, int], None],
        step_retries: int,
    ) -> None:
        self._queues = queues
        self._blocks = blocks
        self._admission = admission
        self._in_flight = in_flight
        self._journal = journal
        self._counters = counters
        self._requeue = requeue  # a running sequence off the device, back to waiting
        self._abort = abort  # a live request ended, its blocks released
        self._cancel = cancel  # an op's completion applied as "cancelled"
        self._step_retries = step_retries  # failed steps in a row retried; one more aborts

    def step_failed(self, op: StepOp, status: str) -> list[Request]:
        """Step ``op`` came back ``status`` (not "ok"): retry or abort its running sequences
        (see the module doc) and void the step in flight after it. Returns the requests
        it aborted."""
        failed = []
        for piece in op.pieces:
            seq = self._queues.seqs.get(piece.seq_id)
            if seq is None or seq.request.state is not RequestState.RUNNING:
                continue
            # What the step wrote is spoiled, and so is every copy made of it since.
            self._blocks.forget_copies(seq.blocks, seq.keys)
            seq.failed_steps += 1
            if status == "failed" and seq.failed_steps <= self._step_retries:
                self._journal.record("retry", seq, computed=seq.request.num_computed_tokens)
                self._requeue(seq)
                self._counters.retries += 1
            else:
                failed.append(self._abort(seq.request.request_id))
        self._void_next()
        return [r for r in failed if r is not None]

    def _void_next(self) -> None:
        """A step failed with the next one in flight: that one may take tokens the failed
        one never sampled (the Worker fails it then), so it is void (its result will be
        dropped), and every sequence of it still running is computed again, copies of its
        blocks forgotten (what it writes may be spoiled, as a failed step's)."""
        for op in self._in_flight.void_rest():
            for piece in op.pieces:
                seq = self._queues.seqs.get(piece.seq_id)
                if seq is None or seq.request.state is not RequestState.RUNNING:
                    continue
                self._blocks.forget_copies(seq.blocks, seq.keys)
                self._journal.record("retry", seq, computed=seq.request.num_computed_tokens)
                self._requeue(seq)
                self._counters.retries += 1

    def lost_host_copies(self, blocks: set[BlockId]) -> None:
        """Host blocks a failed swap-out was to fill hold nothing: a swap-preempted request
        holding any of them gives up its host copies and is computed again instead."""
        for seq in self._queues.waiting:
            tail = seq.tail.host_block if seq.tail is not None else None
            if tail in blocks or blocks.intersection(seq.held):
                self._blocks.release_host(seq.take_holds())

    def reset_device(self) -> list[Request]:
        """The device tier was reset (the Worker restarted): its blocks hold nothing now.

        Every op in flight counts as failed: its executor cancels it as stale (see
        ``ringfence.actors.executors.lanes``), and its completion, of the old epoch, is not
        applied (the caller drops it). So the step's tokens are never applied, swap-outs'
        host copies are forgotten, and a prefetching request waits to be admitted again.
        Every running request loses its device blocks and goes back to waiting, its output
        so far kept: it is computed again (from host, storage or scratch) and seeded
        sampling gives the same next tokens. Returns the requests sent back, oldest first.

        Numbers and fences go on: a new op on a block an old op touched still waits for
        that op's watermark, which the old op's cancellation advances.
        """
        self._in_flight.clear()
        for lane, number in list(self._blocks.issuer.inflight):
            seq = self._admission.prefetches.get(number) if lane is Lane.STORE else None
            if seq is None:
                self._cancel(lane, number)
                continue
            self._blocks.completed(lane, number, "cancelled")
            # Not a storage failure (storage may be used again): no storage_until.
            self._admission.drop_prefetch(seq)
            seq.request.transition(RequestState.WAITING)
        requeued = sorted(self._queues.running, key=lambda s: s.seq_id)
        for seq in requeued:
            self._journal.record("reset", seq, computed=seq.request.num_computed_tokens)
            self._requeue(seq)
        self._blocks.reset_device()
        self._counters.resets += 1
        return [seq.request for seq in requeued]

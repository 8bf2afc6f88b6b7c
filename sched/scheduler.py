"""The continuous-batching scheduler: requests in, fenced ops out. Pure and deterministic.

The engine calls :meth:`Scheduler.schedule` whenever the step lane has room
(:attr:`can_schedule`); it returns the ops to issue, in issue order: the transfer ops
that admission, preemption and demotion need, then at most one step. The engine applies
the step's result with :meth:`on_step` and transfer completions with :meth:`on_transfer`,
then schedules again. Nothing here reads a clock or does I/O (the storage presence object
the caller passes is the one exception, and its answers only steer reuse, never
correctness); the same calls in the same order give the same ops.

A step (continuous batching with chunked prefill):

1. running sequences that decode (one token each), oldest admitted first;
2. running sequences still prefilling, a chunk each within the token budget;
3. waiting requests, first come first served, while the budget, ``max_num_seqs`` and
   the free device blocks allow. Admission takes the longest cached prefix across the
   tiers (:meth:`BlockManager.match`): device hits take references, host hits become
   swap-ins, storage hits become a prefetch, and the request waits for its completion
   (failed blocks are recomputed). A request that does not fit waits: admission never
   preempts, and a request never overtakes an earlier one. This path, prefetches
   included, is :class:`ringfence.sched.admission.Admission`.

When a running sequence needs a block and none is free, the newest admitted running
sequence not yet in this step is preempted (possibly the sequence itself), by the
configured policy (recompute, swap or save): :class:`ringfence.sched.preemption.Preemption`.

Preempted requests go back to the head of the waiting queue, oldest first. A step's
KV counts as computed when the step is issued ("free at issue, fence at use"): the
fences order every later op that touches its blocks after it. The blocks it fills get
their keys once it is issued (:class:`ringfence.sched.pieces.PieceMaker`).

With ``sched.steps_in_flight = 2`` the engine may schedule step N+1 while step N runs,
and a decode of N+1 may take the token N samples: :mod:`ringfence.sched.in_flight`.

Blocks are the :class:`BlockManager`'s: the scheduler allocates, holds and releases
them, and issues ops, through its methods only, never through its pools.

A prefill instance (``SchedulerConfig.handover``) writes every full block of a finishing
request to storage (:mod:`sched.handovers`); a decode instance admits requests by
reservation (:meth:`reserve`, :mod:`ringfence.sched.reservations`). docs/design.md,
"Instances (prefill/decode disaggregation)".

The live sequences and their waiting and running queues are
:class:`ringfence.sched.queues.Queues`. What a failed step, a failed swap-out and a lost
device tier (a Worker restart, :meth:`reset_device`) do is
:class:`ringfence.sched.faults.Faults`'s: a failed step's sequences are computed again, up
to :data:`STEP_RETRIES` times without a token between them, then aborted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ringfence.cache.fences import Access, Lane
from ringfence.cache.ids import BlockId
from ringfence.cache.kv_events import KVEventJournal
from ringfence.cache.prefix_index import StoragePresence
from ringfence.sched.admission import Admission
from ringfence.sched.blocks import BlockManager
from ringfence.sched.config import SchedulerConfig
from ringfence.sched.faults import Faults
from ringfence.sched.handovers import HandOvers
from ringfence.sched.in_flight import StepsInFlight, check_tokens, follows
from ringfence.sched.limits import check_fits
from ringfence.sched.ops import Op, Piece, StepOp, SwapOp
from ringfence.sched.pieces import PieceMaker
from ringfence.sched.preemption import Preemption
from ringfence.sched.queues import Queues
from ringfence.sched.request import Request, RequestError, RequestState
from ringfence.sched.reservations import Refusal, Reservation, Reservations
from ringfence.sched.sequence import (
    Counters,
    Decision,
    Emitted,
    Journal,
    Sequence,
)

STEP_RETRIES = 3  # failed steps in a row a request is computed again after; one more aborts


class Scheduler:
    """See the module docstring. Owned by the engine; not thread-safe."""

    def __init__(
        self,
        config: SchedulerConfig,
        storage: StoragePresence | None = None,
        *,
        journal: bool = False,
        first_numbers: Mapping[Lane, int] | None = None,
        kv_events: KVEventJournal | None = None,
    ) -> None:
        """``first_numbers``: the number of each lane's first op (1 unless an engine
        before this one left its lanes further on). ``kv_events``: KV events' journal."""
        self.config = config
        self.blocks = BlockManager(
            config.tiers, storage, first_numbers, keep_access=journal, events=kv_events
        )
        self.counters = Counters()
        # The decisions of the current round, for the engine's log (see take_decisions).
        self._journal = Journal(journal)
        self._bs = config.tiers.block_size
        self._pieces = PieceMaker(self._bs, config.namespace, kv_events)
        self._admission = Admission(config, self.blocks, self._pieces, self.counters, self._journal)
        self.queues = Queues()
        self._preemption = Preemption(
            config,
            blocks=self.blocks,
            pieces=self._pieces,
            queues=self.queues,
            journal=self._journal,
            counters=self.counters,
        )
        self._in_flight = StepsInFlight(config.steps_in_flight)
        self._busy: frozenset[int] = frozenset()  # sequences of the steps in flight (schedule)
        self.reservations = Reservations(self._bs, config.sched.reserve_blocks)
        self.handovers = HandOvers(self.blocks, self._pieces, self._bs)  # handover only
        self._faults = Faults(
            queues=self.queues,
            blocks=self.blocks,
            admission=self._admission,
            in_flight=self._in_flight,
            journal=self._journal,
            counters=self.counters,
            requeue=self._preemption.requeue,
            abort=self.abort,
            cancel=lambda lane, number: self.on_transfer(lane, number, "cancelled"),
            step_retries=STEP_RETRIES,
        )

    # Requests.

    def add(self, request: Request, reservation: str = "") -> int:
        """Queue a request (state WAITING); returns its sequence id. RequestError if it can
        never run: a prompt token outside the vocabulary, a prompt plus max_tokens longer
        than ``max_model_len`` (refused at once, as vLLM's server refuses it, rather than
        cut short at the limit: the client learns before any token that its answer cannot
        fit) or than the whole device pool; or if ``reservation`` is given and is not live
        or not for this request (field "reservation"). A live one is taken: its room is now
        the request's."""
        if request.request_id in self.queues.by_id:
            raise RequestError(f"request id {request.request_id!r} is already live", field="id")
        check_fits(
            self.config, request.request_id, request.prompt_token_ids, request.params.max_tokens
        )
        if reservation:
            try:
                self.reservations.claim(
                    reservation, request.prompt_token_ids, request.params.max_tokens
                )
            except KeyError:
                raise RequestError(
                    f"reservation {reservation!r} expired or was never granted",
                    field="reservation",
                ) from None
            except ValueError as e:
                raise RequestError(str(e), field="reservation") from None
        return self.queues.add(request).seq_id

    def abort(self, request_id: str) -> Request | None:
        """Abort a live request, releasing its blocks; None if it is not live."""
        seq = self.queues.by_id.get(request_id)
        if seq is None:
            return None
        seq.request.abort()
        self._release(seq)
        self.queues.leave(seq)
        return seq.request

    def request_of(self, seq_id: int) -> Request | None:
        """The live request of sequence ``seq_id`` (None once it ended)."""
        seq = self.queues.seqs.get(seq_id)
        return seq.request if seq is not None else None

    def request(self, request_id: str) -> Request | None:
        seq = self.queues.by_id.get(request_id)
        return seq.request if seq is not None else None

    @property
    def num_live(self) -> int:
        return len(self.queues.by_id)

    @property
    def num_running(self) -> int:
        return len(self.queues.running)

    @property
    def num_waiting(self) -> int:
        return len(self.queues.waiting)

    # Prefill and decode instances (docs/design.md, "Instances (prefill/decode disaggregation)").

    def reserve(
        self,
        reservation_id: str,
        prompt_token_ids: tuple[int, ...],
        max_tokens: int,
        expires_at: float,
    ) -> Reservation | Refusal:
        """Room for a request to be claimed by :meth:`add` before ``expires_at``, or why not
        (:mod:`ringfence.sched.reservations`): a request that can never run is refused for
        good, one that does not fit now with ``retry``."""
        try:
            check_fits(self.config, reservation_id, prompt_token_ids, max_tokens)
        except RequestError as e:
            return Refusal(str(e), retry=False)
        lives = (
            (s.request.num_prompt_tokens, s.request.params.max_tokens, len(s.blocks))
            for s in self.queues.seqs.values()
        )
        return self.reservations.grant(
            reservation_id,
            prompt_token_ids,
            max_tokens,
            free_blocks=self.blocks.device.num_free,
            headroom=self.reservations.growth(lives),
            expires_at=expires_at,
        )

    # Scheduling.

    def schedule(self) -> list[Op]:
        """The ops of the next step, in issue order (empty when nothing can run now).

        Call only while :attr:`can_schedule`: with one step in flight (two allowed), a
        sequence whose token it samples may get a decode of that token (module doc).
        """
        if not self._in_flight.room:
            raise RuntimeError(
                f"schedule() called with {len(self._in_flight)} steps in flight, "
                f"sched.steps_in_flight is {self.config.steps_in_flight}"
            )
        behind = self._in_flight.behind
        self._busy = self._in_flight.busy()
        budget = self.config.sched.max_batched_tokens
        pieces: list[Piece] = []
        scheduled: set[int] = set()
        running = self.queues.running
        decoding: list[Sequence] = []
        prefilling: list[Sequence] = []
        for seq in running:  # each one's wanted once: this loop runs over every sequence
            wanted = self._wanted(seq)
            if wanted == 1 or follows(seq, behind):
                decoding.append(seq)
            if wanted > 1:
                prefilling.append(seq)
        for seq in decoding + prefilling:
            if budget == 0:
                break
            # Preempted for an earlier one in this loop: preemption takes a sequence out of
            # running and makes it PREEMPTED, so its state says so without a search of the
            # running list for every sequence.
            if seq.request.state is not RequestState.RUNNING:
                continue
            wanted = self._wanted(seq)
            if wanted == 0:  # its input is the token the step behind samples
                piece = self._grow_pending(seq, behind, scheduled)
            else:
                piece = self._grow(seq, min(wanted, budget), scheduled)
            if piece is not None:
                pieces.append(piece)
                scheduled.add(seq.seq_id)
                budget -= len(piece.token_ids)
        budget = self._admission.admit(self.queues.waiting, running, budget, pieces, scheduled)
        if pieces:
            step = self.blocks.issue_step(pieces, self._pieces.take_closed())
            self._in_flight.issued(step, self.queues.seqs)
            self.counters.steps += 1
            self.counters.batched_tokens += self.config.sched.max_batched_tokens - budget
        self._pieces.key_filled(self.blocks)  # after the step: see ringfence.sched.pieces
        return self.blocks.issuer.take_ops()

    def take_decisions(self) -> list[Decision]:
        """The admissions, prefetches and preemptions since the last call, in order
        (always empty unless the scheduler was built with ``journal=True``)."""
        return self._journal.take()

    def take_access(self, op: Op) -> Access | None:
        """The block sets ``op`` declared to the fence tracker, once (None unless the
        scheduler was built with ``journal=True``): the trace's ``declared``."""
        return self.blocks.issuer.tracker.take_access(op.lane, op.number)

    def _wanted(self, seq: Sequence) -> int:
        """Tokens the sequence could compute now: all known tokens without KV."""
        return seq.request.num_uncomputed_tokens

    def _grow(self, seq: Sequence, count: int, scheduled: set[int]) -> Piece | None:
        """A piece of ``count`` tokens for a running sequence, allocating its blocks,
        preempting newer sequences if it must (None if the blocks cannot be had)."""
        start = seq.request.num_computed_tokens
        if not self._preemption.room(seq, start + count, scheduled, self._busy):
            return None
        return self._pieces.make(seq, count)

    def _grow_pending(self, seq: Sequence, behind: int, scheduled: set[int]) -> Piece | None:
        """The decode of the token step ``behind`` samples for the sequence (module doc),
        its block allocated as for any decode (None if it cannot be had)."""
        if not self._preemption.room(seq, seq.request.num_tokens + 1, scheduled, self._busy):
            return None
        return self._pieces.make_pending(seq, behind)

    # Results and completions.

    def on_step(
        self, step: int, status: str, outputs: Iterable[tuple[int, int]]
    ) -> tuple[list[Emitted], list[Request]]:
        """Apply step ``step``'s result: (seq_id, token_id) pairs. Returns what each request
        produced, and the requests that a failed step ended (aborted; see the module doc).
        Results come in step order; a voided step's is dropped (see the module doc)."""
        op = self._in_flight.applied(step)
        if op is None:  # void: a failed step before it (sched/in_flight.py)
            return [], []
        if status != "ok":
            return [], self._faults.step_failed(op, status)
        emitted = []
        for seq_id, token in outputs:
            seq = self.queues.seqs.get(seq_id)
            if seq is None or seq.request.state is not RequestState.RUNNING:
                continue  # aborted while the step ran (or finished: a dropped token)
            seq.failed_steps = 0  # a token came: the retries are for failures in a row
            reason = seq.request.append_output(token)
            seq.sampled_by = 0
            if seq.pending_in and reason is None:  # the step in flight decodes this token
                self._took_pending(seq)
            if reason is not None:
                self._finish(seq)
            emitted.append(Emitted(seq.request, (token,), reason is not None, seq.seq_id))
        # A decode in flight must not wait for a token never sent.
        check_tokens(op, self.queues.seqs)
        self._pieces.key_filled(self.blocks)  # the blocks pending decodes fill (issued)
        return emitted, []

    def _took_pending(self, seq: Sequence) -> None:
        """The token just applied is the input of the sequence's decode in the step in
        flight: its KV counts as computed from now on, and a block it fills is keyed now
        (the step that fills it is issued: see ``sched.pieces``)."""
        r = seq.request
        r.computed_one()
        seq.sampled_by, seq.pending_in = seq.pending_in, 0
        full = r.num_computed_tokens // self._bs
        if full > seq.num_keyed:  # a block filled: only then are its tokens read (a new tuple)
            self._pieces.queue_keys(seq, r.all_token_ids, full)

    def _finish(self, seq: Sequence) -> None:
        self.queues.running.remove(seq)
        if self.config.handover:
            self.handovers.write(seq)  # its blocks are read before they are freed (fenced)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        """Give back every block the sequence holds and forget it."""
        if seq.blocks:
            self.blocks.free_device(seq.blocks)
            seq.blocks = []
        self.blocks.release_host(seq.take_holds())
        self._admission.drop_prefetch(seq)
        self.queues.forget(seq)
        self._pieces.close(seq)  # the Worker may keep its Opening, even from before a preemption

    def on_transfer(self, lane: Lane, op: int, status: str, missing: Iterable[int] = ()) -> None:
        """Apply a transfer completion. A prefetch's request waits again (its blocks now on
        host, the missing ones to be recomputed); any other failed op's blocks are forgotten."""
        done = self.blocks.completed(lane, op, status)
        if lane is Lane.STORE and op in self._admission.prefetches:
            self._admission.prefetched(op, status, set(missing))
        elif status != "ok" and isinstance(done, SwapOp) and done.direction == "out":
            self._faults.lost_host_copies({BlockId(b) for b in done.host_blocks})

    # Faults.

    def reset_device(self) -> list[Request]:
        """The device tier was reset (the Worker restarted): every op in flight counts as
        failed and every running request goes back to waiting, its output so far kept
        (:meth:`ringfence.sched.faults.Faults.reset_device`). Returns the requests sent
        back, oldest first."""
        return self._faults.reset_device()

    @property
    def step_in_flight(self) -> StepOp | None:
        """The oldest step issued whose result has not been applied yet."""
        return self._in_flight.oldest

    @property
    def num_steps_in_flight(self) -> int:
        """Steps issued whose results have not been applied yet."""
        return len(self._in_flight)

    @property
    def can_schedule(self) -> bool:
        """Whether :meth:`schedule` may be called: fewer steps in flight than allowed."""
        return self._in_flight.room

    @property
    def idle(self) -> bool:
        """No live request and no op issued outside a round (a hand-over's writes): nothing
        to schedule until one arrives."""
        return not self.queues.by_id and not self.blocks.issuer.has_ops

"""The Engine actor: drives the scheduler, issues its ops to the lanes, applies what comes back.

The engine owns every number of the protocol. It waits for the Worker's and both
Transfer lanes' announcements, builds the :class:`Scheduler` (which needs the model's
identity and limits), then runs a loop made of messages only:

- requests arrive from a workload (``engine.workload``: timers at their ``arrival_s``)
  or from clients (:class:`ClientHub`);
- whenever the step lane is idle, :meth:`Scheduler.schedule` gives the next ops; they
  are queued per lane and sent in issue order while the lane has credit (bounded ops
  in flight, so no result ring ever fills); in ``transfer.mode = "sync"`` an op is
  held until every op its fence names has completed, then sent with no fence;
- a :class:`StepResult` or :class:`OpDone` of an older epoch, a repeat or one of an op
  never sent is dropped; otherwise it is applied to the scheduler, tokens stream to
  their clients, and the loop schedules again. Ops in flight per lane are the lane's
  last number sent minus the last one completed, so a repeated completion (a lane
  restarted after it sent one) can never free a credit twice.

Faults (DESIGN.md "Sequence numbers" on epochs and restarts):

- the engine (re)starts by publishing its epoch as ``issuer_epoch`` (every op an engine
  before it issued is stale from then on and is cancelled, never run) and sending each
  executor a :class:`Resync`; it begins once all three answered, numbering each lane's
  ops after the watermark the answer carries. A workload run then runs its workload
  from the start (seeded sampling gives the same tokens); a client's requests in
  flight end with an error on its side, and its next request says Hello again;
- a Worker that restarts has a fresh device tier: the engine adopts its epoch,
  :meth:`Scheduler.reset_device` sends every running request back to be computed
  again, and the swap lane is told the new tier;
- a Transfer lane that restarts redoes its op in flight from its ring and resends a
  completion lost with it: nothing to do here but tell the swap lane the tier again.

A workload run ends by writing ``outputs.jsonl`` and ``summary.json`` and asking for
shutdown; at stop the engine waits (``engine.drain_timeout_s``) for the store lane's
writes in flight, so the next instance on the same storage finds them.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from ringfence.actors.config import Config
from ringfence.actors.engine.clients import ClientHub, RequestKey, RequestRefused
from ringfence.actors.engine.report import (
    Progress,
    RequestRecord,
    summarize,
    write_run_report,
)
from ringfence.actors.engine.serving import (
    issue_fields,
    load_workload,
    make_request,
    open_storage,
    sched_config,
)
from ringfence.actors.executors.lanes import ISSUER_EPOCH, LANES, epoch_counter, lane_counter
from ringfence.actors.model.checkpoint import CheckpointTokenizer, load_tokenizer
from ringfence.actors.model.tokenizer import ByteTokenizer
from ringfence.actors.protocol.client import Abort, Hello, Submit
from ringfence.actors.protocol.resync import Resync
from ringfence.actors.protocol.transfer import DeviceTier, LaneReady, OpDone
from ringfence.actors.protocol.worker import ModelInfo, StepResult, WorkerReady
from ringfence.cache.fences import NO_WAIT, Lane
from ringfence.cache.ids import BlockHash
from ringfence.cache.prefix_index import StoragePresence
from ringfence.cache.storage import StorageBackend
from ringfence.runtime.actor import Actor, handles
from ringfence.runtime.log import ActorLog
from ringfence.runtime.messages import Tick
from ringfence.sched.ops import Op
from ringfence.sched.request import Request, RequestError, SamplingParams
from ringfence.sched.scheduler import Scheduler
from ringfence.sched.workload import WorkloadRequest
from ringfence.shm.errors import ProtocolError

CREDITS = {Lane.STEP: 1, Lane.SWAP: 8, Lane.STORE: 8}  # ops in flight per lane
TARGET = {Lane.STEP: "worker", Lane.SWAP: "swap", Lane.STORE: "store"}
LANE_OF = {"swap": Lane.SWAP, "store": Lane.STORE}
EXECUTORS = {"worker": Lane.STEP, "swap": Lane.SWAP, "store": Lane.STORE}


@dataclass(frozen=True, slots=True)
class Arrive:
    """Timer: the workload requests due by now arrive."""


@dataclass(slots=True)
class _Times:
    request: Request
    key: RequestKey | None  # the client's key, None for a workload request
    arrival: float  # seconds since the engine's clock started
    first: float | None = None
    finish: float | None = None


class Engine(Actor):
    """See the module docstring."""

    config_section = ""
    tick_s = 0.5

    def on_start(self) -> None:
        config = self.ctx.config
        assert isinstance(config, Config)
        self.config = config
        self.sync = config.transfer.mode == "sync"
        self.clients = ClientHub(
            lambda to, m: self.send(to, m, timeout=0),
            self.log,
            max_live=config.engine.max_requests_per_client,
        )
        self.scheduler: Scheduler | None = None
        self.storage: StorageBackend | None = None
        self.model: ModelInfo | None = None
        self.tier: DeviceTier | None = None
        self.incarnations: dict[str, int] = {}  # executor -> the incarnation last announced
        self.synced: dict[str, int] = {}  # executor -> its watermark when it answered Resync
        # Ops waiting for credit, each with the epoch it was issued in (a Worker restart
        # between issue and send must not make an op of the lost tier look current).
        self.queues: dict[Lane, deque[tuple[Op, int]]] = {lane: deque() for lane in Lane}
        self.completed = dict.fromkeys(Lane, 0)  # per lane: the last op number completed
        self.last_sent = dict.fromkeys(Lane, 0)
        self.sent_epoch: dict[Lane, dict[int, int]] = {lane: {} for lane in Lane}  # in flight
        self.bytes: dict[str, int] = {}
        self.times: dict[str, _Times] = {}
        self.records: list[RequestRecord] = []
        self.workload: list[WorkloadRequest] = []
        self.next_arrival = 0
        self.clock0 = time.perf_counter()
        self.done = False
        self.progress: Progress | None = None
        self.output_tokens = 0
        self.epoch = self.ctx.epoch  # stamped on every op; a Worker restart raises it
        self.tokenizer: ByteTokenizer | CheckpointTokenizer | None = None
        # Every op an engine before this one issued is stale from now on; then ask each
        # executor where its lane stands once it has handled what is in its ring.
        issuer = epoch_counter(self.ctx.counters[LANES], self.ctx.rank, ISSUER_EPOCH)
        issuer.claim()
        issuer.advance(self.epoch)
        if self.ctx.incarnation > 1:
            self.log.warning("engine.restart", incarnation=self.ctx.incarnation)
        for target in EXECUTORS:
            self.send(target, Resync(epoch=self.ctx.epoch))

    def on_stop(self) -> None:
        self._drain_store()
        if self.progress is not None:
            self.progress.close()
        if self.storage is not None:
            self.storage.close()

    def now(self) -> float:
        return time.perf_counter() - self.clock0

    # Startup.

    @handles(WorkerReady)
    def on_worker(self, msg: WorkerReady) -> None:
        if not self._announced("worker", msg.incarnation, msg.resync, msg.step_done):
            return
        if self.model is not None and msg.model.model_id != self.model.model_id:
            raise ProtocolError(
                f"the worker restarted with model {msg.model.model_id}, not {self.model.model_id}"
            )
        restarted = self.model is not None and self.incarnations["worker"] != msg.incarnation
        self.incarnations["worker"] = msg.incarnation
        self.model = msg.model
        self.epoch = max(self.epoch, msg.epoch)  # ops of the old tier are stale from here
        self.tier = DeviceTier(epoch=self.epoch, kv=msg.kv)
        if self.scheduler is None:
            self._maybe_begin()
        elif restarted:
            self._reset_tier(msg)

    @handles(LaneReady)
    def on_lane(self, msg: LaneReady) -> None:
        if not self._announced(msg.lane, msg.incarnation, msg.resync, msg.done):
            return
        restarted = self.incarnations.setdefault(msg.lane, msg.incarnation) != msg.incarnation
        self.incarnations[msg.lane] = msg.incarnation
        if self.scheduler is None:
            self._maybe_begin()
        elif restarted:  # it redoes its op in flight from its ring and resends what was lost
            self.log.warning("engine.lane_restart", lane=msg.lane, done=msg.done)
            if msg.lane == "swap" and self.tier is not None:
                self.send("swap", self.tier)

    def _announced(self, executor: str, incarnation: int, resync: int, done: int) -> bool:
        """Record an executor's announcement; False if it answers another engine's Resync."""
        if resync >= 0 and resync != self.ctx.epoch:
            return False
        if resync >= 0 and self.scheduler is None:
            self.synced[executor] = done
        self.incarnations.setdefault(executor, incarnation)
        if executor == "worker" and self.scheduler is not None:
            # A new Worker does not answer for steps at or below its watermark whose
            # results went with its predecessor: they count as completed.
            self._complete_up_to(Lane.STEP, done)
        return True

    def _reset_tier(self, msg: WorkerReady) -> None:
        """The Worker restarted: its device tier is new, every op in flight is lost."""
        assert self.scheduler is not None and self.tier is not None
        if self.log.tracing:
            self.log.trace("sched.reset", tier_epoch=msg.epoch)
        requeued = self.scheduler.reset_device()
        self.log.warning(
            "engine.tier_reset",
            incarnation=msg.incarnation,
            new_epoch=self.epoch,
            step_done=msg.step_done,
            requeued=[r.request_id for r in requeued],
        )
        self.send("swap", self.tier)  # before any op of the new epoch
        self._kick()

    def _maybe_begin(self) -> None:
        """Begin once every executor answered this engine's Resync (and the worker's model
        is known): each lane's numbers go on after the watermark it answered with."""
        if self.scheduler is not None or set(self.synced) != set(EXECUTORS) or self.model is None:
            return
        assert self.ctx.run_dir is not None and self.tier is not None
        first = {lane: self.synced[name] + 1 for name, lane in EXECUTORS.items()}
        for lane, number in first.items():
            self.completed[lane] = self.last_sent[lane] = number - 1
        self.storage = open_storage(self.config, self.model, str(self.ctx.run_dir), log=self.log)
        tracing = self.log.tracing
        presence = LoggedPresence(self.storage, self.log) if tracing and self.storage else None
        self.scheduler = Scheduler(
            sched_config(
                self.config, self.model.model_id, self.model.max_position, self.model.vocab_size
            ),
            presence or self.storage,
            journal=tracing,
            first_numbers=first,
        )
        self.send("swap", self.tier)
        settings = self.config.engine
        self.log.info(
            "engine.ready",
            model_id=self.model.model_id,
            max_position=self.model.max_position,
            vocab_size=self.model.vocab_size,
            workload=settings.workload,
            first_ops={str(lane): number for lane, number in first.items()},
        )
        if settings.workload:
            try:
                self.workload = load_workload(
                    settings.workload, seed=settings.seed, requests=settings.requests or None
                )
            except (ValueError, OSError) as e:  # the launch checked it; it changed since
                self.log.error("engine.workload_failed", workload=settings.workload, error=str(e))
                self.done = True
                self.request_shutdown(f"workload {settings.workload} failed to load: {e}")
                return
            if not settings.arrivals:
                self.workload = [replace(w, arrival_s=0.0) for w in self.workload]
            if settings.progress:
                self.progress = Progress(len(self.workload), stream=sys.stderr)
            self.clock0 = time.perf_counter()
            self.on_arrive(Arrive())

    # Requests in.

    @handles(Arrive)
    def on_arrive(self, msg: Arrive) -> None:
        now = self.now()
        while self.next_arrival < len(self.workload):
            line = self.workload[self.next_arrival]
            if line.arrival_s > now:
                self.schedule(line.arrival_s - now, Arrive())
                break
            self.next_arrival += 1
            request = make_request(line, self._encode)
            try:
                self._add(request, None, line.arrival_s)
            except RequestError as e:  # it can never run (e.g. a token outside the vocabulary)
                self._refused(request, line.arrival_s, str(e))
        self._kick()

    def _refused(self, request: Request, arrival: float, error: str) -> None:
        """A workload request the scheduler refused: it ends at once, aborted with ``error``."""
        self.log.warning("request.refused", request=request.request_id, error=error)
        self.records.append(
            RequestRecord(
                id=request.request_id,
                prompt_tokens=request.num_prompt_tokens,
                token_ids=(),
                finish_reason="abort",
                error=error,
                arrival_s=arrival,
                first_token_s=None,
                finish_s=self.now(),
                cached_tokens=dict(request.cached_tokens),
            )
        )

    def _encode(self, text: str) -> list[int]:
        """A text prompt's ids: the checkpoint's tokenizer, or bytes for the presets."""
        if self.tokenizer is None:
            path = self.config.model.path
            self.tokenizer = (load_tokenizer(path) if path else None) or ByteTokenizer()
        return self.tokenizer.encode(text)

    def _add(self, request: Request, key: RequestKey | None, arrival: float) -> None:
        assert self.scheduler is not None
        if self.log.tracing:  # before the call: replay repeats it, RequestError included
            self.log.trace(
                "sched.add",
                request=request.request_id,
                prompt=list(request.prompt_token_ids),
                params=asdict(request.params),
            )
        seq_id = self.scheduler.add(request)
        self.times[request.request_id] = _Times(request, key, arrival)
        self.log.info(
            "request.arrive",
            request=request.request_id,
            seq_id=seq_id,
            prompt_tokens=request.num_prompt_tokens,
            max_tokens=request.params.max_tokens,
            arrival_s=round(arrival, 6),
        )

    @handles(Hello)
    def on_hello(self, msg: Hello) -> None:
        for key in self.clients.hello(self._peer(), msg):
            self._abort(key, "the client attached again")
        self._flush()

    @handles(Submit)
    def on_submit(self, msg: Submit) -> None:
        peer = self._peer()
        try:
            if self.scheduler is None:
                raise RequestRefused("the engine is starting: its worker is not ready yet")
            key = self.clients.submit(peer, msg)
        except RequestRefused as e:
            self.clients.reject(peer, msg.request_id, str(e))
            self._flush()
            return
        try:
            params = SamplingParams(
                max_tokens=msg.max_tokens,
                temperature=msg.temperature,
                seed=msg.seed,
                stop_token_ids=msg.stop_token_ids,
            )
            tokens = msg.prompt_token_ids or tuple(self._encode(msg.prompt))
            request = Request(request_id=key, prompt_token_ids=tokens, params=params)
            self._add(request, key, self.now())
        except RequestError as e:  # e.g. longer than the model: the request ends here
            self.clients.emit(key, finish_reason="abort", error=str(e))
        self._kick()

    @handles(Abort)
    def on_abort(self, msg: Abort) -> None:
        key = self.clients.abort(self._peer(), msg.request_id)
        if key is not None:
            self._abort(key, "")
        self._kick()

    def _peer(self) -> str:
        delivery = self.ctx.services.current
        assert delivery is not None
        return delivery.peer

    def _abort(self, request_id: str, error: str) -> None:
        if self.scheduler is None:
            return
        if self.log.tracing:
            self.log.trace("sched.abort", request=request_id)
        if self.scheduler.abort(request_id) is not None:
            self._finished(request_id, error)

    # Issuing.

    def _kick(self) -> None:
        """Schedule the next step if the step lane is idle, then send what has credit."""
        scheduler = self.scheduler
        if scheduler is not None and not self.done:
            if scheduler.step_in_flight is None and not scheduler.idle:
                ops = scheduler.schedule()
                for op in ops:
                    self.queues[op.lane].append((op, self.epoch))
                if self.log.tracing:
                    self.log.trace(
                        "sched.schedule",
                        ops=[[str(op.lane), op.number] for op in ops],
                        decisions=[list(d) for d in scheduler.take_decisions()],
                    )
            self._pump()
        self._flush()
        self._maybe_end()

    def in_flight(self, lane: Lane) -> int:
        """Ops sent to ``lane`` whose completion has not come back."""
        return self.last_sent[lane] - self.completed[lane]

    def _pump(self) -> None:
        for lane, queue in self.queues.items():
            while queue and self.in_flight(lane) < CREDITS[lane]:
                op, epoch = queue[0]
                sent = op
                if self.sync:
                    waits = op.fence.waits()
                    if any(self.completed[other] < seq for other, seq in waits.items()):
                        break
                    sent = replace(op, fence=NO_WAIT)
                queue.popleft()
                self.last_sent[lane] = op.number
                self.sent_epoch[lane][op.number] = epoch
                self.send(TARGET[lane], replace(sent, epoch=epoch))
                if self.log.tracing:
                    self._trace_issue(op)

    def _trace_issue(self, op: Op) -> None:
        """``op.issue`` with the scheduler's fence (in sync mode the message's is empty:
        the engine waited for those ops itself) and every block the op touches."""
        f = issue_fields(op)  # a step's fields or a transfer's; the others are None
        self.log.trace(
            "op.issue",
            lane=str(op.lane),
            op=op.number,
            fence=f["fence"],
            sync=self.sync,
            pieces=f.get("pieces"),
            poison=f.get("poison"),
            direction=f.get("direction"),
            reason=f.get("reason"),
            device_blocks=f.get("device_blocks"),
            host_blocks=f.get("host_blocks"),
        )

    # Results and completions.

    @handles(StepResult)
    def on_step(self, msg: StepResult) -> None:
        scheduler = self.scheduler
        if not self._settled(Lane.STEP, msg.step, msg.epoch):
            return
        assert scheduler is not None
        if msg.status != "ok":
            self.log.error("engine.step_failed", step=msg.step, status=msg.status, error=msg.error)
        outputs = [(t.seq_id, t.token_id) for t in msg.outputs]
        if self.log.tracing:
            self.log.trace(
                "sched.step", step=msg.step, msg_epoch=msg.epoch, status=msg.status, outputs=outputs
            )
        emitted, failed = scheduler.on_step(msg.step, msg.status, outputs)
        now = self.now()
        for e in emitted:
            rid = e.request.request_id
            times = self.times[rid]
            first = times.first is None
            if first:
                times.first = now
            self.output_tokens += len(e.token_ids)
            if times.key is not None:
                self.clients.emit(
                    times.key,
                    e.token_ids,
                    cached_tokens=dict(e.request.cached_tokens) if first else None,
                    ttft_s=now - times.arrival if first else -1.0,
                )
            if e.finished:
                self._finished(rid, "")
        for request in failed:
            self._finished(request.request_id, f"step {msg.step} {msg.status}: {msg.error}")
        self._kick()

    @handles(OpDone)
    def on_op(self, msg: OpDone) -> None:
        scheduler = self.scheduler
        lane = LANE_OF[msg.lane]
        if not self._settled(lane, msg.op, msg.epoch):
            return
        assert scheduler is not None
        if msg.status != "ok":
            self.log.warning("engine.op_failed", lane=msg.lane, op=msg.op, status=msg.status)
        op = scheduler.blocks.inflight.get((lane, msg.op))
        if op is not None:
            name = f"{msg.lane}_{op.direction}"
            self.bytes[name] = self.bytes.get(name, 0) + msg.bytes
        if self.log.tracing:
            self.log.trace(
                "sched.transfer",
                lane=msg.lane,
                op=msg.op,
                msg_epoch=msg.epoch,
                status=msg.status,
                missing=list(msg.missing),
            )
        scheduler.on_transfer(lane, msg.op, msg.status, msg.missing)
        self._kick()

    def _complete_up_to(self, lane: Lane, number: int) -> None:
        """Every op of ``lane`` up to ``number`` is complete: forget their sent epochs."""
        sent = self.sent_epoch[lane]
        for done in range(self.completed[lane] + 1, number + 1):
            sent.pop(done, None)
        self.completed[lane] = max(self.completed[lane], number)

    def _settled(self, lane: Lane, number: int, epoch: int) -> bool:
        """Count op ``number``'s completion; whether it is to be applied to the scheduler.

        Not applied: a repeat (a restarted executor resends a completion that may have
        arrived), one of an op never sent (nothing to apply it to), one stamped with another
        epoch than the op was sent with (no executor sends that: it is not counted), or one
        of an older epoch (the scheduler already took that op as lost in a reset). Each is
        logged.
        """
        why = ""
        sent = self.sent_epoch[lane]
        if self.scheduler is None:
            why = "before the engine began"
        elif number <= self.completed[lane]:
            why = f"a repeat: {lane} is complete up to {self.completed[lane]}"
        elif number > self.last_sent[lane]:
            why = f"never sent: the last {lane} op sent is {self.last_sent[lane]}"
        elif sent.get(number, epoch) != epoch:
            why = f"the op was sent with epoch {sent[number]}, not {epoch}"
        else:
            self._complete_up_to(lane, number)
            if epoch == self.epoch:
                return True
            why = f"of epoch {epoch}, the engine's is {self.epoch}"
        self.log.warning("engine.stale", lane=str(lane), op=number, msg_epoch=epoch, why=why)
        return False

    def _finished(self, request_id: str, error: str) -> None:
        assert self.scheduler is not None
        times = self.times.pop(request_id)
        times.finish = self.now()
        request = times.request
        self.log.info(
            "request.finish",
            request=request_id,
            reason=str(request.finish_reason or "abort"),
            output_tokens=request.num_output_tokens,
            cached_tokens=dict(request.cached_tokens),
            error=error,
        )
        if times.key is not None:
            self.clients.emit(
                times.key, finish_reason=str(request.finish_reason or "abort"), error=error
            )
            return
        self.records.append(
            RequestRecord(
                id=request.request_id,
                prompt_tokens=request.num_prompt_tokens,
                token_ids=tuple(request.output_token_ids),
                finish_reason=str(request.finish_reason or "abort"),
                error=error,
                arrival_s=times.arrival,
                first_token_s=times.first,
                finish_s=times.finish,
                cached_tokens=dict(request.cached_tokens),
            )
        )
        if self.progress is not None:
            self.progress.update(len(self.records), self.now(), tokens=self.output_tokens)

    # Ticks, the end of a workload, shutdown.

    @handles(Tick)
    def on_tick(self, msg: Tick) -> None:
        for key in self.clients.stuck_or_dead():
            self._abort(key, "the client is gone or does not read its outputs")
        if self.progress is not None:
            self.progress.update(len(self.records), self.now(), tokens=self.output_tokens)
        self._kick()

    def _flush(self) -> None:
        if self.clients.pending():
            self.clients.flush()

    def _maybe_end(self) -> None:
        if self.done or not self.workload or len(self.records) < len(self.workload):
            return
        if any(self.queues[lane] for lane in Lane) or self.in_flight(Lane.STORE):
            return  # the write-backs go out and finish first
        self.done = True
        assert self.ctx.run_dir is not None
        summary = summarize(self.records, duration_s=self.now(), engine=self.counters())
        order = {w.id: i for i, w in enumerate(self.workload)}
        records = sorted(self.records, key=lambda r: order[r.id])
        write_run_report(self.ctx.run_dir, records, summary)
        if self.progress is not None:
            self.progress.close()
            self.progress = None
        self.log.info(
            "engine.workload_done", requests=len(records), duration_s=summary["duration_s"]
        )
        self.request_shutdown(f"workload {self.config.engine.workload} done")

    def counters(self) -> dict[str, Any]:
        assert self.scheduler is not None
        c = self.scheduler.counters
        moved = self.scheduler.blocks.moved
        return {
            "mode": self.config.transfer.mode,
            "preemption_policy": self.config.sched.preemption,
            "preemptions": dict(c.preemptions),
            "hit_tokens": dict(c.hit_tokens),
            "steps": c.steps,
            "resets": c.resets,
            "retries": c.retries,
            "batched_tokens": c.batched_tokens,
            "ops": dict(moved.ops),
            "blocks": dict(moved.blocks),
            "bytes": dict(self.bytes),
        }

    def _drain_store(self) -> None:
        """Wait (with a deadline) until the store lane has done every op sent to it."""
        last = self.last_sent[Lane.STORE]
        if last == 0 or LANES not in self.ctx.counters:
            return
        done = lane_counter(self.ctx.counters[LANES], self.ctx.rank, Lane.STORE)
        if not self.wait_until(
            lambda: done.value() >= last, timeout=self.config.engine.drain_timeout_s
        ):
            self.log.warning("engine.drain_timeout", store_done=done.value(), last_sent=last)


class LoggedPresence:
    """The storage tier's presence answers, each logged (``sched.storage``) so that a
    replay can give a fresh scheduler the same answers without the storage."""

    def __init__(self, backend: StoragePresence, log: ActorLog) -> None:
        self.backend = backend
        self.log = log

    def longest_prefix(self, keys: Sequence[BlockHash]) -> int:
        found = self.backend.longest_prefix(keys)
        self.log.trace("sched.storage", asked=len(keys), found=found)
        return found

"""The Engine actor: drives the scheduler, issues its ops to the lanes, applies what comes back.

The engine owns every number of the protocol. It begins once the Worker and both Transfer
lanes of every rank have answered its ``Resync`` (the :class:`Executors` it holds, which also
handles their restarts: :mod:`.executors`), building the :class:`Scheduler` (which needs the
model's identity and limits) and its client of the storage tier (:mod:`.begin`). Then it
runs a loop made of messages only:

- requests arrive from a workload (``engine.workload``: timers at their ``arrival_s``) or
  from clients (:class:`ClientHub`), and become the scheduler's requests (:mod:`.intake`;
  the handlers in :mod:`.requests_in`, an object the engine holds);
- whenever the step lane has room (one step in flight, or two with
  ``sched.steps_in_flight = 2``), :meth:`Scheduler.schedule` gives the next ops; the
  ledger (:mod:`.ledger`) sends them in issue order to every rank while the lane has
  credit, so no result ring ever fills (in ``transfer.mode = "sync"`` an op is held until
  every op its fence names is complete, then sent with no fence);
- a :class:`StepResult` or :class:`OpDone` is counted per rank; an op complete on every
  rank is applied to the scheduler, and tokens go to their clients or to the run's
  records (:mod:`.outputs`); then the loop schedules again;
- on each Tick, once right after a Hello that asks for them, and between ticks when the
  requests running or waiting changed, the clients that asked get the engine's
  :class:`Stats` (:mod:`.stats`; zeros with ``began`` False until the scheduler began);
- a prefill or decode instance (``engine.role``) holds finishes until their blocks are
  stored, or grants reservations (:mod:`.disaggregation`; docs/design.md,
  "Instances (prefill/decode disaggregation)").

Faults (docs/design.md, "Epochs and restarts"): a restarted engine publishes its epoch and
resyncs every executor (:meth:`Executors.resync`); a workload run then runs its workload from
the start (seeded sampling gives the same tokens), and a client's requests in flight end with
an error on its side (its next request says Hello again). A restarted Worker or lane is
:mod:`.executors`' to handle.

A workload run ends by writing ``outputs.jsonl`` and ``summary.json`` and asking for
shutdown; at stop the engine waits (``engine.drain_timeout_s``) for the store lanes'
writes in flight, so the next instance on the same storage finds them.
"""

from __future__ import annotations

import time
from typing import Any

from ringfence.actors.engine.begin import begin_scheduler
from ringfence.actors.engine.clients import ClientHub
from ringfence.actors.engine.config import EngineSettings
from ringfence.actors.engine.disaggregation import Expire, HandOverDesk
from ringfence.actors.engine.executors import Executors
from ringfence.actors.engine.intake import Intake
from ringfence.actors.engine.kv_events import KVEventsOut
from ringfence.actors.engine.ledger import LANE_OF, Ledger, Outcome
from ringfence.actors.engine.outputs import Outputs, emitted_logprobs, file_prompt_logprobs
from ringfence.actors.engine.requests_in import Arrive, RequestsIn
from ringfence.actors.engine.stats import count_bytes, counters_of, no_stats, stats_of
from ringfence.actors.protocol.client import Abort, Hello, Reserve, Stats, Submit
from ringfence.actors.protocol.lanes import LANES, lane_counter
from ringfence.actors.protocol.transfer import LaneReady, OpDone
from ringfence.actors.protocol.worker import StepResult, WorkerReady
from ringfence.cache.fences import Lane
from ringfence.cache.storage.ranks import AllRanks
from ringfence.runtime.actor import Actor, handles
from ringfence.runtime.messages import Tick
from ringfence.sched.scheduler import Scheduler
from ringfence.sched.workload import returning_turns
from ringfence.shm.counter import wait_or_gone


class Engine(Actor):
    """See the module docstring. Its handlers only route: each concern has its module; the
    requests coming in are handled by the :class:`RequestsIn` it holds (``requests``), which
    calls back through :class:`~ringfence.actors.engine.requests_in.EngineSide`."""

    config_section = EngineSettings  # only the sections it reads
    tick_s = 0.5

    def on_start(self) -> None:
        config = self.ctx.config
        assert isinstance(config, EngineSettings)
        self.config = config
        self.ranks = config.parallel.tp_size
        self.clock0 = time.perf_counter()
        self.clients = ClientHub(
            lambda to, m: self.send(to, m, timeout=0),
            self.log,
            max_live=config.engine.max_requests_per_client,
            send_many=lambda to, ms: self.send_many(to, ms, timeout=0),
        )
        self.ledger = Ledger(
            self.ranks,
            sync=config.transfer.mode == "sync",
            send_all=self.send_all_many,
            log=self.log,
            step_credits=config.sched.steps_in_flight,
        )
        self.intake = Intake(config)
        self.outputs = Outputs(self.clients, self.log, self.now)
        self.desk = HandOverDesk(  # prefill/decode instances' hand-over
            config.engine, self.clients, self.outputs, self.log, self.schedule, now=self.now
        )
        self.requests = RequestsIn(
            self,
            intake=self.intake,
            outputs=self.outputs,
            clients=self.clients,
            desk=self.desk,
            log=self.log,
            schedule=self.schedule,
        )
        self.executors = Executors(  # the Workers and lanes: their announcements and restarts
            self,
            epoch=self.ctx.epoch,
            ranks=self.ranks,
            ledger=self.ledger,
            send=self.send,
            log=self.log,
        )
        self.scheduler: Scheduler | None = None
        self.kv_out: KVEventsOut | None = None  # KV events, once the scheduler began
        self.storage: AllRanks | None = None  # every rank's presence, from the first begin
        self.bytes: dict[str, int] = {}
        self.done = False
        if self.ctx.incarnation > 1:
            self.log.warning("engine.restart", incarnation=self.ctx.incarnation)
        self.executors.resync(self.ctx.counters[LANES], self.send_all)

    def on_stop(self) -> None:
        self._drain_store()
        if self.kv_out is not None:
            self.kv_out.close()
        self.outputs.close()
        if self.storage is not None:
            self.storage.close()

    def now(self) -> float:
        """Seconds since the engine's clock started (a workload's arrivals count from it)."""
        return time.perf_counter() - self.clock0

    # Requests coming in: each handler one line, into the RequestsIn the engine holds.

    @handles(Arrive)
    def on_arrive(self, msg: Arrive) -> None:
        self.requests.arrive()

    @handles(Hello)
    def on_hello(self, msg: Hello) -> None:
        self.requests.hello(self._peer(), msg)

    @handles(Submit)
    def on_submit(self, msg: Submit) -> None:
        self.requests.submit(self._peer(), msg)

    @handles(Reserve)
    def on_reserve(self, msg: Reserve) -> None:
        self.requests.reserve(self._peer(), msg)

    @handles(Expire)
    def on_expire(self, msg: Expire) -> None:
        self.requests.expire(msg)

    @handles(Abort)
    def on_abort(self, msg: Abort) -> None:
        self.requests.abort(self._peer(), msg)

    def _peer(self) -> str:
        """The client instance whose message is being handled."""
        delivery = self.ctx.services.current
        assert delivery is not None
        return delivery.peer

    # The executors announcing themselves: each handler one line, into the Executors held.

    @handles(WorkerReady)
    def on_worker(self, msg: WorkerReady) -> None:
        self.executors.worker_ready(msg)

    @handles(LaneReady)
    def on_lane(self, msg: LaneReady) -> None:
        self.executors.lane_ready(msg)

    # Beginning and issuing.

    def begin(self) -> None:
        """Begin once every executor answered this engine's Resync (and the worker's model is
        known): each lane's numbers go on after the watermarks it answered with."""
        executors = self.executors
        model = executors.model
        if self.scheduler is not None or not executors.ready or model is None:
            return
        assert self.ctx.run_dir is not None
        first = executors.roster.first_numbers()
        self.ledger.begin(first)
        try:
            begun = begin_scheduler(self.config, model, first, str(self.ctx.run_dir), self.log)
        except ValueError as e:  # the launch checked it against the model the config names
            self.log.error("engine.config_failed", error=str(e))
            self.done = True
            self.request_shutdown(str(e))
            return
        self.scheduler, self.storage, self.kv_out = begun.scheduler, begun.storage, begun.kv_out
        if self.log.tracing:
            self.ledger.access_of = self.scheduler.take_access
        executors.tell_tiers()
        engine = self.config.engine
        self.log.info(
            "engine.ready",
            model_id=model.model_id,
            max_position=model.max_position,
            vocab_size=model.vocab_size,
            workload=engine.workload,
            first_ops={str(lane): number for lane, number in first.items()},
        )
        if engine.workload:
            try:
                self.intake.load()
            except (ValueError, OSError) as e:  # the launch checked it; it changed since
                self.log.error("engine.workload_failed", workload=engine.workload, error=str(e))
                self.done = True
                self.request_shutdown(f"workload {engine.workload} failed to load: {e}")
                return
            self.outputs.returning = returning_turns(self.intake.workload)
            if engine.progress:
                self.outputs.start_progress(len(self.intake.workload))
            self.clock0 = time.perf_counter()
            self.requests.arrive()

    def kick(self) -> None:
        """Schedule steps while the step lane has room (``sched.steps_in_flight``: with 2,
        step N+1 is planned as soon as N is issued, so the Worker finds it in its ring
        when N ends), then send what has credit."""
        scheduler = self.scheduler
        if scheduler is not None and not self.done and not self.executors.regrouping:
            while scheduler.can_schedule and not scheduler.idle:
                ops = scheduler.schedule()
                self.ledger.queue(ops, self.executors.epoch)
                if self.log.tracing:
                    self.log.trace(
                        "sched.schedule",
                        ops=[[str(op.lane), op.number] for op in ops],
                        decisions=[list(d) for d in scheduler.take_decisions()],
                    )
                if not any(op.lane is Lane.STEP for op in ops):
                    break  # nothing more to plan until a result or a completion comes
            self.ledger.pump()
        self.flush()
        self._maybe_end()

    # Results and completions.

    @handles(StepResult)
    def on_step(self, msg: StepResult) -> None:
        done = self._settle(Lane.STEP, msg.rank, msg)
        if done is None or self.scheduler is None:
            return
        if done.status != "ok":
            self.log.error(
                "engine.step_failed", step=done.number, status=done.status, error=done.error
            )
        outputs = done.sampled.pairs()
        if self.log.tracing:
            self.log.trace(
                "sched.step", step=done.number, msg_epoch=msg.epoch, status=done.status,
                outputs=outputs,
            )  # fmt: skip
        emitted, failed = self.scheduler.on_step(done.number, done.status, outputs)
        file_prompt_logprobs(done.prompt_logprobs, emitted, self.scheduler.request_of)
        rows = dict(zip(done.sampled.seq_ids, range(len(done.sampled)), strict=True))
        for e in emitted:
            logprobs, prompt = emitted_logprobs(e, done.sampled, rows)
            self.outputs.emitted(
                e, hold=self.scheduler.config.handover, logprobs=logprobs, prompt_logprobs=prompt
            )
        # Finishes wait for writes (docs/design.md, "Instances (prefill/decode disaggregation)").
        if self.scheduler.config.handover:
            self.desk.hold(self.scheduler.handovers.take())
            self.desk.settle(self.ledger.completed(Lane.STORE), self.scheduler)
        for request in failed:
            error = f"step {done.number} {done.status}: {done.error}"
            self.outputs.finished(request.request_id, error)
        self.kick()

    @handles(OpDone)
    def on_op(self, msg: OpDone) -> None:
        lane = LANE_OF[msg.lane]
        done = self._settle(lane, msg.rank, msg)
        if done is not None and self.scheduler is not None:
            if done.status != "ok":
                self.log.warning(
                    "engine.op_failed", lane=msg.lane, op=done.number, status=done.status
                )
            count_bytes(self.bytes, self.scheduler, done.lane, done.number, done.bytes)
            if self.log.tracing:
                self.log.trace(
                    "sched.transfer", lane=msg.lane, op=done.number, msg_epoch=msg.epoch,
                    status=done.status, missing=list(done.missing),
                )  # fmt: skip
            self.scheduler.on_transfer(lane, done.number, done.status, done.missing)
        if lane is Lane.STORE and self.scheduler is not None:
            # After the write's outcome is applied: a failed one is not counted as stored.
            self.desk.settle(self.ledger.completed(Lane.STORE), self.scheduler)
        self.kick()

    def _settle(self, lane: Lane, rank: int, report: StepResult | OpDone) -> Outcome | None:
        """The ledger's outcome of one rank's report (None: nothing to apply yet, or ever)."""
        if self.scheduler is not None:
            return self.ledger.settle(lane, rank, report, self.executors.epoch)
        why = "before the engine began"
        number = report.step if isinstance(report, StepResult) else report.op
        self.log.warning("engine.stale", lane=str(lane), op=number, msg_epoch=report.epoch, why=why)
        return None

    # Ticks, the end of a workload, shutdown.

    @handles(Tick)
    def on_tick(self, msg: Tick) -> None:
        for key in self.clients.stuck_or_dead():
            self.requests.end(key, "the client is gone or does not read its outputs")
        if self.clients.watching():
            self.clients.post_stats(self.stats())
        self.outputs.show_progress()
        self.kick()  # flushes the Stats too

    def flush(self) -> None:
        """Send what is queued for the clients (and the KV events), scheduling nothing."""
        if self.kv_out is not None:
            self.kv_out.flush()
        if (s := self.scheduler) is not None:
            self.clients.post_stats_if_moved(s.num_running, s.num_waiting, self.stats)
        if self.clients.pending():
            self.clients.flush()

    def _maybe_end(self) -> None:
        workload = self.intake.workload
        if self.done or not workload or len(self.outputs.records) < len(workload):
            return
        if self.ledger.waiting() or self.ledger.in_flight(Lane.STORE):
            return  # the write-backs go out and finish first
        if self.ledger.in_flight(Lane.STEP):
            return  # a decode planned ahead (steps_in_flight 2) for a finished request still runs
        self.done = True
        assert self.ctx.run_dir is not None
        order = {w.id: i for i, w in enumerate(workload)}
        summary = self.outputs.write_report(self.ctx.run_dir, order, self.counters())
        self.log.info(
            "engine.workload_done", requests=len(workload), duration_s=summary["duration_s"]
        )
        self.request_shutdown(f"workload {self.config.engine.workload} done")

    def stats(self) -> Stats:
        """The engine's state now, for the clients that asked (the hub sets incarnation)."""
        if self.scheduler is None:
            return no_stats()
        events = None if self.kv_out is None else self.kv_out.endpoints
        return stats_of(self.scheduler, self.ledger, self.bytes, events)

    def counters(self) -> dict[str, Any]:
        assert self.scheduler is not None
        return counters_of(self.scheduler, self.config.transfer.mode, self.bytes)

    def _drain_store(self) -> None:
        """Wait (with a deadline) until every rank's store lane did every op sent to it, or
        until each that has not is gone (a run whose supervisor died: its lanes stop too,
        and a dead lane's watermark never advances, so waiting on would only hold this
        process to the deadline)."""
        last = self.ledger.last_sent(Lane.STORE)
        if last == 0 or LANES not in self.ctx.counters:
            return
        block = self.ctx.counters[LANES]
        marks = [lane_counter(block, rank, Lane.STORE) for rank in range(self.ranks)]
        short = wait_or_gone(
            marks,
            last,
            timeout=self.config.engine.drain_timeout_s,
            wait=lambda ready, seconds: self.wait_until(ready, timeout=seconds),
            look_every=self.ctx.runtime.heartbeat_s,
        )
        if short:
            done = min(m.value() for m in marks)
            gone = [m.name for m in short if m.writer_gone()]
            self.log.warning("engine.drain_timeout", store_done=done, last_sent=last, gone=gone)

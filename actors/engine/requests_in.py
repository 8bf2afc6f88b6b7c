"""The engine's handlers of requests coming in: a workload's arrivals, clients' Hello,
Submit and Abort, and the reservations of a decode instance.

Each handler turns a message into the scheduler's request (:mod:`.intake`), its refusal,
or its end, then asks the engine to issue (:meth:`EngineSide.kick`): the engine actor
(:mod:`.actor`) owns the scheduler, the lanes and everything that comes back from the
executors, and holds a :class:`RequestsIn` whose methods its handler table names, one
line each. A request that can never run (longer than the model, a token outside the
vocabulary) ends here with its error, to its client or in the run's records; one refused
before it became a request (the engine starting, the client over its limit, a reservation
it does not hold) is answered at once with the reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

from ringfence.actors.engine.clients import ClientHub, RequestKey, RequestRefused
from ringfence.actors.engine.disaggregation import Expire, HandOverDesk
from ringfence.actors.engine.intake import Intake
from ringfence.actors.engine.outputs import Outputs
from ringfence.actors.protocol.client import Abort, Hello, Reserve, Stats, Submit
from ringfence.runtime.log import ActorLog
from ringfence.sched.request import Request, RequestError
from ringfence.sched.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class Arrive:
    """Timer: the workload requests due by now arrive."""


class EngineSide(Protocol):
    """What the request handlers ask of the engine that holds them (the Engine actor)."""

    @property
    def scheduler(self) -> Scheduler | None:
        """The scheduler, None until the engine began."""
        ...

    def now(self) -> float:
        """Seconds since the engine's clock started (a workload's arrivals count from it)."""
        ...

    def stats(self) -> Stats:
        """The engine's state now, for a client whose Hello asks for it."""
        ...

    def kick(self) -> None:
        """Schedule and send what the scheduler has now, then flush to the clients."""
        ...

    def flush(self) -> None:
        """Send what is queued for the clients (and the KV events), scheduling nothing."""
        ...


class RequestsIn:
    """See the module docstring. Engine thread only; mutates the engine's scheduler (adds and
    aborts requests), its intake's place in the workload, its outputs and its client hub.

    ``schedule(delay_s, msg)`` hands ``msg`` back to the engine's own handler after
    ``delay_s`` (the next :class:`Arrive`)."""

    def __init__(
        self,
        engine: EngineSide,
        *,
        intake: Intake,
        outputs: Outputs,
        clients: ClientHub,
        desk: HandOverDesk,
        log: ActorLog,
        schedule: Callable[[float, object], None],
    ) -> None:
        self.engine = engine
        self.intake, self.outputs, self.clients, self.desk = intake, outputs, clients, desk
        self.log = log
        self.schedule = schedule

    def arrive(self) -> None:
        """The workload's requests due by now become the scheduler's (an :class:`Arrive`)."""
        lines, wait = self.intake.due(self.engine.now())
        for line in lines:
            request = self.intake.request(line)
            try:
                self._add(request, None, line.arrival_s)
            except RequestError as e:  # it can never run (e.g. a token outside the vocabulary)
                self.outputs.refused(request, line.arrival_s, str(e))
        if wait is not None:
            self.schedule(wait, Arrive())
        self.engine.kick()

    def _add(
        self, request: Request, key: RequestKey | None, arrival: float, reservation: str = ""
    ) -> None:
        scheduler = self.engine.scheduler
        assert scheduler is not None
        if self.log.tracing:  # before the call: replay repeats it, RequestError included
            self.log.trace(
                "sched.add",
                request=request.request_id,
                prompt=list(request.prompt_token_ids),
                params=asdict(request.params),
                cache_salt=request.cache_salt,
            )
        seq_id = scheduler.add(request, reservation)
        if reservation:
            self.log.info("reservation.claim", reservation=reservation, request=request.request_id)
        self.outputs.arrived(request, key, arrival)
        self.log.info(
            "request.arrive",
            request=request.request_id,
            seq_id=seq_id,
            prompt_tokens=request.num_prompt_tokens,
            max_tokens=request.params.max_tokens,
            arrival_s=round(arrival, 6),
        )

    def hello(self, peer: str, msg: Hello) -> None:
        """Client instance ``peer`` attached: what an incarnation before it left unfinished
        ends, and it gets the Stats at once if it asks for them."""
        for key in self.clients.hello(peer, msg):
            self.end(key, "the client attached again")
        if msg.stats:
            self.clients.post_stats(self.engine.stats(), peer)
        self.engine.flush()

    def submit(self, peer: str, msg: Submit) -> None:
        """Client instance ``peer``'s new request: refused at once, ended with its error, or
        the scheduler's."""
        scheduler = self.engine.scheduler
        try:
            if scheduler is None:
                raise RequestRefused("the engine is starting: its worker is not ready yet")
            reservation = self.desk.claimed(peer, msg, scheduler)
            key = self.clients.submit(peer, msg)
        except RequestRefused as e:
            self.clients.reject(peer, msg.request_id, str(e), e.code)
            self.engine.flush()
            return
        try:
            now = self.engine.now()
            self._add(self.intake.submitted(msg, key, now), key, now, reservation)
        except RequestError as e:  # e.g. longer than the model: the request ends here
            self.clients.emit(key, finish_reason="abort", error=str(e))
        self.engine.kick()

    def reserve(self, peer: str, msg: Reserve) -> None:
        """A router's reservation for client instance ``peer`` (a decode instance's)."""
        self.desk.reserve(peer, msg, self.engine.scheduler)
        self.engine.flush()

    def expire(self, msg: Expire) -> None:
        """A reservation's timer: unclaimed, it expires."""
        self.desk.expire(msg, self.engine.scheduler)

    def abort(self, peer: str, msg: Abort) -> None:
        """Client instance ``peer`` gives up on its request (nothing if it already ended)."""
        key = self.clients.abort(peer, msg.request_id)
        if key is not None:
            self.end(key, "")
        self.engine.kick()

    def end(self, request_id: str, error: str) -> None:
        """End a request the scheduler holds (nothing if it already ended, or before the
        engine began)."""
        scheduler = self.engine.scheduler
        if scheduler is None:
            return
        if self.log.tracing:
            self.log.trace("sched.abort", request=request_id)
        if scheduler.abort(request_id) is not None:
            self.outputs.finished(request_id, error)

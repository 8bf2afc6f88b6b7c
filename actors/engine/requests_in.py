"""The engine's handlers of requests coming in: a workload's arrivals, clients' Hello,
Submit and Abort, and the reservations of a decode instance.

Each handler turns a message into the scheduler's request (:mod:`.intake`), its refusal,
or its end, then asks the engine to issue (``_kick``): the engine actor (:mod:`.actor`)
owns the scheduler, the lanes and everything that comes back from the executors. A request
that can never run (longer than the model, a token outside the vocabulary) ends here with
its error, to its client or in the run's records; one refused before it became a request
(the engine starting, the client over its limit, a reservation it does not hold) is
answered at once with the reason.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ringfence.actors.engine.clients import ClientHub, RequestKey, RequestRefused
from ringfence.actors.engine.disaggregation import Expire, HandOverDesk
from ringfence.actors.engine.intake import Intake
from ringfence.actors.engine.outputs import Outputs
from ringfence.actors.protocol.client import Abort, Hello, Reserve, Stats, Submit
from ringfence.runtime.actor import Actor, handles
from ringfence.sched.request import Request, RequestError
from ringfence.sched.scheduler import Scheduler


@dataclass(frozen=True, slots=True)
class Arrive:
    """Timer: the workload requests due by now arrive."""


class RequestsIn(Actor):
    """The request side of :class:`~ringfence.actors.engine.actor.Engine`, which sets these
    attributes in ``on_start`` and gives the three methods below their meaning."""

    scheduler: Scheduler | None  # None until the engine began
    intake: Intake
    outputs: Outputs
    clients: ClientHub
    desk: HandOverDesk

    def now(self) -> float:
        """Seconds since the engine's clock started (a workload's arrivals count from it)."""
        raise NotImplementedError

    def stats(self) -> Stats:
        raise NotImplementedError

    def _kick(self) -> None:
        """Schedule and send what the scheduler has now, then flush to the clients."""
        raise NotImplementedError

    def _flush(self) -> None:
        raise NotImplementedError

    @handles(Arrive)
    def on_arrive(self, msg: Arrive) -> None:
        lines, wait = self.intake.due(self.now())
        for line in lines:
            request = self.intake.request(line)
            try:
                self._add(request, None, line.arrival_s)
            except RequestError as e:  # it can never run (e.g. a token outside the vocabulary)
                self.outputs.refused(request, line.arrival_s, str(e))
        if wait is not None:
            self.schedule(wait, Arrive())
        self._kick()

    def _add(
        self, request: Request, key: RequestKey | None, arrival: float, reservation: str = ""
    ) -> None:
        assert self.scheduler is not None
        if self.log.tracing:  # before the call: replay repeats it, RequestError included
            self.log.trace(
                "sched.add",
                request=request.request_id,
                prompt=list(request.prompt_token_ids),
                params=asdict(request.params),
                cache_salt=request.cache_salt,
            )
        seq_id = self.scheduler.add(request, reservation)
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

    @handles(Hello)
    def on_hello(self, msg: Hello) -> None:
        peer = self._peer()
        for key in self.clients.hello(peer, msg):
            self._abort(key, "the client attached again")
        if msg.stats:
            self.clients.post_stats(self.stats(), peer)
        self._flush()

    @handles(Submit)
    def on_submit(self, msg: Submit) -> None:
        peer = self._peer()
        try:
            if self.scheduler is None:
                raise RequestRefused("the engine is starting: its worker is not ready yet")
            reservation = self.desk.claimed(peer, msg, self.scheduler)
            key = self.clients.submit(peer, msg)
        except RequestRefused as e:
            self.clients.reject(peer, msg.request_id, str(e), e.code)
            self._flush()
            return
        try:
            now = self.now()
            self._add(self.intake.submitted(msg, key, now), key, now, reservation)
        except RequestError as e:  # e.g. longer than the model: the request ends here
            self.clients.emit(key, finish_reason="abort", error=str(e))
        self._kick()

    @handles(Reserve)
    def on_reserve(self, msg: Reserve) -> None:
        self.desk.reserve(self._peer(), msg, self.scheduler)
        self._flush()

    @handles(Expire)
    def on_expire(self, msg: Expire) -> None:
        self.desk.expire(msg, self.scheduler)

    @handles(Abort)
    def on_abort(self, msg: Abort) -> None:
        key = self.clients.abort(self._peer(), msg.request_id)
        if key is not None:
            self._abort(key, "")
        self._kick()

    def _peer(self) -> str:
        """The client instance whose message is being handled."""
        delivery = self.ctx.services.current
        assert delivery is not None
        return delivery.peer

    def _abort(self, request_id: str, error: str) -> None:
        """End a request the scheduler holds (nothing if it already ended)."""
        if self.scheduler is None:
            return
        if self.log.tracing:
            self.log.trace("sched.abort", request=request_id)
        if self.scheduler.abort(request_id) is not None:
            self.outputs.finished(request_id, error)

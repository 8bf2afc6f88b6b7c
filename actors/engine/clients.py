"""The engine's side of its clients: who is attached, whose request is whose, who is lost.

The Engine owns one :class:`ClientHub` and calls it from its handlers, in its own
thread; the hub knows nothing about scheduling, and never blocks, sleeps or starts a
thread. It turns a client's request id into an engine-wide :data:`RequestKey`
(``"<peer>/<incarnation>/<request id>"``), queues each request's output for the
client that owns it (in the client's :class:`~.outbox.Outbox`), and tells the engine
which requests to abort because their client went away or stopped reading (its outbox
passed ``max_queued`` messages).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import NamedTuple, NewType

from ringfence.actors.engine.outbox import Flushed, Outbox, Queued
from ringfence.actors.protocol.client import (
    FINISH_REASONS,
    Hello,
    Reservation,
    Stats,
    Submit,
    check_submit,
)
from ringfence.runtime.log import ActorLog
from ringfence.sched.sampling import TokenLogprobs
from ringfence.shm.errors import RingfenceError
from ringfence.shm.liveness import ProcessStamp

RequestKey = NewType("RequestKey", str)  # "<peer>/<incarnation>/<request id>", engine-wide
STATS_MIN_S = 0.02  # between two Stats sent for a change of load (besides each tick's)
MAX_QUEUED = 4096  # messages queued for one client before it is given up on
MAX_LIVE = (
    256  # unfinished requests of one client; more are refused (engine.max_requests_per_client)
)


class RequestRefused(RingfenceError, ValueError):
    """A Submit the hub (or the engine) will not accept; the engine answers it with
    :meth:`ClientHub.reject`, passing on ``code`` (``Rejected.code``)."""

    def __init__(self, message: str, code: str = "") -> None:
        super().__init__(message)
        self.code = code


class _Owner(NamedTuple):
    peer: str  # the client instance, e.g. "client-2"
    incarnation: int
    request_id: str  # the client's own id


@dataclass(slots=True)
class _Client:
    """One client instance (slot) as the hub knows it: its latest incarnation."""

    incarnation: int
    stamp: ProcessStamp
    outbox: Outbox  # its output the ring has not taken, and the Stats held for it
    live: dict[str, RequestKey] = field(default_factory=dict)  # request id -> key
    lost: str = ""  # why its process was given up on ("" while it is served)
    wants_stats: bool = False  # its current Hello asked for Stats


class ClientHub:
    """The engine's bookkeeping of its clients. Engine thread only; never blocks.

    ``send(peer, msg)`` publishes one message to client instance ``peer`` without
    waiting (the engine passes ``lambda to, m: self.send(to, m, timeout=0)``) and
    raises RingFull when the ring has no room, ActorDead when its reader is gone.
    ``send_many(peer, msgs)``, where given, publishes several in order the same way, in
    batches (one doorbell ring each), its RingFull carrying ``sent``: what went before.
    """

    def __init__(
        self,
        send: Callable[[str, object], object],
        log: ActorLog,
        *,
        max_queued: int = MAX_QUEUED,
        max_live: int = MAX_LIVE,
        send_many: Callable[[str, list[object]], object] | None = None,
    ) -> None:
        self._send = send
        self._send_many = send_many
        self._log = log
        self._max_queued = max_queued
        self._max_live = max_live
        self._clients: dict[str, _Client] = {}
        self._owners: dict[RequestKey, _Owner] = {}  # every live request
        self._posted: tuple[int, int, float] = (0, 0, 0.0)  # running, waiting, when: last Stats

    # Requests in.

    def hello(self, peer: str, msg: Hello) -> list[RequestKey]:
        """Record that ``peer`` attached as ``msg.incarnation`` (its process: pid, start_ticks).

        Returns the keys of the previous incarnation's live requests, forgotten here:
        the engine aborts them. What was queued for that incarnation is dropped. A
        repeated Hello of the current incarnation (the client re-announcing itself to a
        restarted engine) only refreshes the process stamp and whether it wants Stats
        (a Stats held for it is dropped if it no longer does), and returns nothing.
        """
        stamp = ProcessStamp(pid=msg.pid, start_ticks=msg.start_ticks)
        old = self._clients.get(peer)
        if old is not None and old.incarnation == msg.incarnation and not old.lost:
            old.stamp = stamp
            old.wants_stats = msg.stats
            if not msg.stats:
                old.outbox.stats = None
            return []
        if old is not None and msg.incarnation < old.incarnation:
            raise RequestRefused(
                f"{peer}: Hello of incarnation {msg.incarnation} after {old.incarnation}"
            )
        orphans = self._drop(old) if old is not None else []
        self._clients[peer] = self._new_client(msg.incarnation, stamp, wants_stats=msg.stats)
        self._log.info(
            "client.hello",
            peer=peer,
            incarnation=msg.incarnation,
            client_pid=msg.pid,
            aborted=len(orphans),
        )
        return orphans

    def submit(self, peer: str, msg: Submit) -> RequestKey:
        """The key of a new request of ``peer``; RequestRefused (nothing recorded) if it is
        invalid, its id is that of an unfinished request of this client, the client has
        ``max_live`` requests unfinished, or ``peer`` has not said Hello or its process is
        gone."""
        client = self._clients.get(peer)
        if client is None:
            raise RequestRefused(f"{peer}: Submit before Hello")
        if client.lost:
            raise RequestRefused(f"{peer}: client given up on: {client.lost}")
        if not client.incarnation:
            raise RequestRefused(f"{peer}: Submit before Hello")
        try:
            check_submit(msg)
        except ValueError as e:
            raise RequestRefused(f"request {msg.request_id!r}: {e}") from None
        if msg.request_id in client.live:
            raise RequestRefused(f"request {msg.request_id!r} is already running")
        if len(client.live) >= self._max_live:
            # Backpressure: a client that floods the engine is told at once, and what it
            # costs here stays bounded (one queued Rejected each, up to max_queued).
            raise RequestRefused(
                f"request {msg.request_id!r}: {peer} has {len(client.live)} requests "
                "unfinished, the most one client may have (engine.max_requests_per_client)"
            )
        key = RequestKey(f"{peer}/{client.incarnation}/{msg.request_id}")
        client.live[msg.request_id] = key
        self._owners[key] = _Owner(peer, client.incarnation, msg.request_id)
        return key

    def abort(self, peer: str, request_id: str) -> RequestKey | None:
        """The key of ``peer``'s unfinished request ``request_id``; None if there is none.

        Records nothing: the request is forgotten when the engine emits its finish.
        """
        client = self._clients.get(peer)
        return None if client is None or client.lost else client.live.get(request_id)

    def reject(self, peer: str, request_id: str, error: str, code: str = "") -> None:
        """Queue a Rejected for ``peer`` (dropped if the hub gave up on that client)."""
        client = self._clients.get(peer)
        incarnation = 0 if client is None else client.incarnation  # 0: no Hello seen
        if client is None:
            client = self._clients[peer] = self._new_client(0, ProcessStamp(0, 0))
        if not client.lost:
            out = Queued(request_id=request_id, incarnation=incarnation, error=error, rejected=True)
            out.code = code
            client.outbox.put(out)

    def scoped(self, peer: str, name: str) -> str | None:
        """``name`` made engine-wide as a request key is (``<peer>/<incarnation>/<name>``);
        None if ``peer`` is not served (no Hello, or given up on)."""
        client = self._clients.get(peer)
        if client is None or client.lost or not client.incarnation:
            return None
        return f"{peer}/{client.incarnation}/{name}"

    def answer_reservation(self, peer: str, answer: Reservation) -> None:
        """Queue ``answer`` for ``peer``'s current incarnation (dropped if it is not served)."""
        client = self._clients.get(peer)
        if client is not None and not client.lost and client.incarnation:
            out = Queued(request_id=answer.reservation_id, incarnation=client.incarnation)
            out.reservation = answer
            client.outbox.put(out)

    # Output.

    def emit(
        self,
        key: RequestKey,
        token_ids: tuple[int, ...] | list[int] = (),
        *,
        finish_reason: str = "",
        error: str = "",
        cached_tokens: Mapping[str, int] | None = None,
        ttft_s: float = -1.0,
        stored_blocks: int = -1,
        logprobs: Sequence[TokenLogprobs] = (),
        prompt_logprobs: Sequence[TokenLogprobs] = (),
    ) -> None:
        """Queue output of request ``key`` for its client; a finish forgets the key.
        ``logprobs``: one per token of ``token_ids`` when the request asked for them.

        A key that is not live (finished, aborted by hello/stuck_or_dead, never
        submitted) is ignored: output may race with a client going away. Tokens merge
        into the request's queued message while the ring has not taken it yet.
        Sends nothing: call :meth:`flush`.
        """
        if finish_reason and finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"finish_reason must be one of {FINISH_REASONS}, got {finish_reason!r}"
            )
        owner = self._owners.get(key)
        if owner is None:
            return
        client = self._clients[owner.peer]
        if finish_reason:
            del self._owners[key]
            del client.live[owner.request_id]
        out = client.outbox.tokens_of(owner.request_id, owner.incarnation, len(token_ids))
        out.token_ids.extend(token_ids)
        out.logprobs.extend(logprobs)
        if prompt_logprobs:
            out.prompt_logprobs = tuple(prompt_logprobs)
        if cached_tokens is not None:
            out.cached_tokens = dict(cached_tokens)
        if ttft_s >= 0 and out.ttft_s < 0:
            out.ttft_s = ttft_s
        if finish_reason:
            out.finish_reason, out.error = finish_reason, error
            out.stored_blocks = stored_blocks
            del client.outbox.open[owner.request_id]

    def watching(self, peer: str | None = None) -> bool:
        """Whether some served client (or ``peer``, if given) asked for Stats in its Hello."""
        clients = self._clients.values() if peer is None else [self._clients.get(peer)]
        return any(c is not None and c.wants_stats and not c.lost for c in clients)

    def post_stats(self, stats: Stats, peer: str | None = None) -> None:
        """Hold ``stats`` for every served client that asked for Stats (or only ``peer``),
        each a copy with its own incarnation, replacing the one held for it if any.

        Not counted against ``max_queued``; sends nothing: call :meth:`flush`.
        """
        for name, client in self._clients.items():
            if (peer is None or name == peer) and client.wants_stats and not client.lost:
                client.outbox.stats = replace(stats, incarnation=client.incarnation)
        if peer is None:
            self._posted = (stats.running, stats.waiting, time.monotonic())

    def post_stats_if_moved(self, running: int, waiting: int, make: Callable[[], Stats]) -> None:
        """Between ticks: post ``make()`` when the requests running or waiting changed since
        the last Stats posted to all, at most once per ``STATS_MIN_S`` (a router weighs
        instances by them: a tick's age would count requests that have ended)."""
        was_running, was_waiting, at = self._posted
        if (running, waiting) == (was_running, was_waiting):
            return
        if time.monotonic() - at >= STATS_MIN_S and self.watching():
            self.post_stats(make())

    def flush(self) -> int:
        """Send queued messages, oldest first per client, then the Stats held for it, until
        each ring is full.

        Never waits. Returns how many were sent; the rest stay queued (see pending).
        """
        sent = 0
        for peer, client in self._clients.items():
            if self._send_many is not None and client.outbox.held() > 1:
                flushed = client.outbox.send_batch(partial(self._send_many, peer))
                sent += self._sent(client, flushed)
            if not client.lost:
                flushed = client.outbox.send_each(partial(self._send, peer))
                sent += self._sent(client, flushed)
        return sent

    def pending(self) -> bool:
        """True while some message (a Stats included) is held and not yet sent."""
        return any(c.outbox.held() for c in self._clients.values())

    def stuck_or_dead(self) -> list[RequestKey]:
        """Keys of the live requests of clients that are gone or not reading; each once.

        A client is gone when its process (the Hello's pid and start_ticks) is not
        alive or its ring's reader is: its requests and queued output are dropped, and
        it is served again only after a new Hello. A client is stuck when more than
        ``max_queued`` messages were queued for it: its queued output is dropped and each
        of its live requests ends, for it, with one Tokens of finish_reason "abort" and
        an error saying why. Either way the returned keys are forgotten here (later
        emits for them are ignored) and the engine aborts them.
        """
        keys: list[RequestKey] = []
        for peer, client in self._clients.items():
            if not client.lost and client.incarnation and not client.stamp.is_alive():
                client.lost = "its process is gone"
                client.outbox.stats = None
            if client.lost and (client.live or client.outbox.queue):
                keys += self._give_up(peer, client, client.lost)
            elif client.outbox.overflowed and not client.lost:
                client.outbox.overflowed = False
                reason = f"its output was not read: more than {self._max_queued} messages queued"
                owners = [self._owners[key] for key in client.live.values()]
                keys += self._give_up(peer, client, reason)
                for owner in owners:  # one final message per request: not held to max_queued
                    out = Queued(request_id=owner.request_id, incarnation=owner.incarnation)
                    out.finish_reason, out.error = "abort", reason
                    client.outbox.queue.append(out)
        return keys

    # Internals.

    def _new_client(
        self, incarnation: int, stamp: ProcessStamp, *, wants_stats: bool = False
    ) -> _Client:
        return _Client(
            incarnation=incarnation,
            stamp=stamp,
            outbox=Outbox(self._max_queued),
            wants_stats=wants_stats,
        )

    def _sent(self, client: _Client, flushed: Flushed) -> int:
        """How many ``flushed`` sent; a ring whose reader is gone loses its client."""
        if flushed.gone:
            client.lost = "its ring's reader is gone"
            client.outbox.stats = None
        return flushed.sent

    def _give_up(self, peer: str, client: _Client, reason: str) -> list[RequestKey]:
        keys = self._drop(client)
        self._log.warning(
            "client.lost",
            peer=peer,
            incarnation=client.incarnation,
            reason=reason,
            aborted=len(keys),
        )
        return keys

    def _drop(self, client: _Client) -> list[RequestKey]:
        """Forget ``client``'s live requests and queued output; the keys it had."""
        keys = list(client.live.values())
        for key in keys:
            del self._owners[key]
        client.live.clear()
        client.outbox.clear()
        return keys

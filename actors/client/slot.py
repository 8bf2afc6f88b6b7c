"""A client slot: the actor a :class:`~ringfence.actors.client.client.Client` drives in its
caller's thread, and what it files of the engine's output.

The run's optional actor ``client`` (:data:`CLIENT_ACTOR`, ``CLIENT_SLOTS`` ranks) has
one ring pair to the engine per slot, carrying :mod:`~ringfence.actors.protocol.client`
messages. :class:`ClientActor` files each message for its request (or reservation), and
drops what was meant for the slot's previous process.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from ringfence.actors.protocol.client import (
    Hello,
    Rejected,
    Reservation,
    Stats,
    Tokens,
)
from ringfence.runtime.actor import Actor, handles
from ringfence.runtime.messages import Failed
from ringfence.runtime.topology import ActorSpec, ChannelSpec
from ringfence.sched.sampling import TokenLogprobs
from ringfence.shm.errors import RingfenceError
from ringfence.shm.liveness import ProcessStamp

CLIENT = "client"  # the actor name of the client slots
ENGINE = "engine"  # the actor a client talks to
CLIENT_SLOTS = 4
CLIENT_ACTOR = ActorSpec(
    name=CLIENT, target=f"{__name__}:ClientActor", ranks=CLIENT_SLOTS, attach="optional"
)
_PROTO = "ringfence.actors.protocol.client"
CLIENT_CHANNELS = (
    ChannelSpec(src=CLIENT, dst=ENGINE, protocol=f"{_PROTO}:CLIENT_TO_ENGINE"),
    ChannelSpec(src=ENGINE, dst=CLIENT, protocol=f"{_PROTO}:ENGINE_TO_CLIENT"),
)


class ClientError(RingfenceError, RuntimeError):
    """A request was rejected or failed, the engine is gone, or the client stopped."""


class Completion(NamedTuple):
    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: str  # "stop", "length" or "abort"
    cached_tokens: dict[str, int]  # prompt tokens served from "device", "host", "storage"
    ttft_s: float  # seconds from submit to first token, as the engine measured it
    stored_blocks: int = -1  # a prefill instance's: leading full blocks storage holds now
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token, when the request asked
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # prompt tokens 2.., when it asked


@dataclass(slots=True)
class _Request:
    """One request of this client, as its output arrives."""

    engine: ProcessStamp | None  # the engine process when it was submitted (None: not started)
    seq: int  # transport seq of its Submit (a Failed reply names it)
    token_ids: list[int] = field(default_factory=list)  # every token so far
    unread: deque[int] = field(default_factory=deque)  # tokens stream() has not yielded
    finish_reason: str = ""
    error: str = ""  # set: rejected, failed or ended abnormally
    cached_tokens: dict[str, int] = field(default_factory=dict)
    ttft_s: float = -1.0
    stored_blocks: int = -1
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()

    @property
    def done(self) -> bool:
        return bool(self.finish_reason or self.error)


class ClientActor(Actor):
    """A client slot's actor: announces itself, files the engine's output per request.

    Runs in the client's process, in the thread that uses the :class:`Client`.
    """

    hello_timeout_s: float | None = None  # how long the Hello may wait for room; None: default
    wants_stats = False  # whether each Hello asks the engine for its Stats

    def on_start(self) -> None:
        self.requests: dict[str, _Request] = {}  # by request id, until the caller took it
        self.dropped = 0  # output for requests this incarnation does not know (stale)
        self.stats: Stats | None = None  # the newest Stats for this incarnation
        self.reservations: dict[str, Reservation] = {}  # answers not taken yet, by id
        self.hello()

    def hello(self) -> None:
        """Announce this incarnation and process to the engine (again, after it restarted)."""
        stamp = ProcessStamp.current()
        msg = Hello(
            incarnation=self.ctx.incarnation,
            pid=stamp.pid,
            start_ticks=stamp.start_ticks,
            stats=self.wants_stats,
        )
        self.send(ENGINE, msg, timeout=self.hello_timeout_s)

    def _mine(self, request_id: str, incarnation: int) -> _Request | None:
        request = self.requests.get(request_id)
        # Incarnation 0: the engine had no Hello from us (it restarted) yet answered.
        if request is None or request.done or incarnation not in (0, self.ctx.incarnation):
            self.dropped += 1  # meant for this slot's previous process, or after the end
            return None
        return request

    @handles(Tokens)
    def on_tokens(self, msg: Tokens) -> None:
        request = self._mine(msg.request_id, msg.incarnation)
        if request is None:
            return
        request.token_ids.extend(msg.token_ids)
        request.logprobs.extend(msg.logprobs)
        if msg.prompt_logprobs:
            request.prompt_logprobs = msg.prompt_logprobs
        request.unread.extend(msg.token_ids)
        if sum(msg.cached_tokens.values()) or not request.cached_tokens:
            request.cached_tokens = dict(msg.cached_tokens)
        if msg.ttft_s >= 0:
            request.ttft_s = msg.ttft_s
        if msg.error:
            request.error = msg.error
        request.stored_blocks = msg.stored_blocks
        request.finish_reason = msg.finish_reason

    @handles(Stats)
    def on_stats(self, msg: Stats) -> None:
        if msg.incarnation != self.ctx.incarnation:
            self.dropped += 1  # meant for this slot's previous process
            return
        self.stats = msg

    @handles(Reservation)
    def on_reservation(self, msg: Reservation) -> None:
        if msg.incarnation in (0, self.ctx.incarnation):
            self.reservations[msg.reservation_id] = msg

    @handles(Rejected)
    def on_rejected(self, msg: Rejected) -> None:
        request = self._mine(msg.request_id, msg.incarnation)
        if request is not None:
            request.error = f"rejected: {msg.error}"

    def handle_failed(self, msg: Failed) -> None:
        super().handle_failed(msg)  # logged; a failed Reserve is seen by its deadline
        for request in self.requests.values():
            if request.seq == msg.seq and not request.done:
                request.error = f"the engine failed on it: {msg.error}: {msg.message}"

"""Outboxes: what the engine holds for one client until that client's ring takes it.

Why queue at all: the engine must never wait for a client. A client process runs
its actor only while its user waits for output, so its ring may be full for a
long time; the outbox keeps what the ring did not take, merging the tokens of one
request into its queued message, and says when it passed ``max_queued`` messages (the
hub then gives up on the client, clients.py).

A client whose current Hello asked for them (``Hello.stats``) also gets the engine's
:class:`Stats`: at most one is held per client, outside its queue and its
``max_queued`` count, a newer one replacing it, and it goes once the client's queued
output has gone (it is a snapshot: a stale one is worth nothing).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from ringfence.actors.protocol.client import (
    Rejected,
    Reservation,
    Stats,
    Tokens,
    no_cached_tokens,
)
from ringfence.sched.sampling import TokenLogprobs
from ringfence.shm.errors import ActorDead, RingFull

MAX_MERGED_TOKENS = 4096  # a queued Tokens takes no more tokens than this (ring frame size)


@dataclass(slots=True)
class Queued:
    """One queued message, mutable while queued so later tokens of its request merge in."""

    request_id: str
    incarnation: int
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    error: str = ""
    cached_tokens: dict[str, int] = field(default_factory=no_cached_tokens)
    ttft_s: float = -1.0
    stored_blocks: int = -1
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per token, if asked
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # the request's first Tokens, if asked
    rejected: bool = False  # a Rejected (error) rather than a Tokens
    code: str = ""  # a Rejected's code
    reservation: Reservation | None = None  # a Reservation rather than either

    def message(self) -> Tokens | Rejected | Reservation:
        if self.reservation is not None:
            return replace(self.reservation, incarnation=self.incarnation)
        if self.rejected:
            return Rejected(
                request_id=self.request_id,
                incarnation=self.incarnation,
                error=self.error,
                code=self.code,
            )
        return Tokens(
            request_id=self.request_id,
            incarnation=self.incarnation,
            token_ids=tuple(self.token_ids),
            logprobs=tuple(self.logprobs),
            prompt_logprobs=self.prompt_logprobs,
            finish_reason=self.finish_reason,
            error=self.error,
            cached_tokens=self.cached_tokens,
            ttft_s=self.ttft_s,
            stored_blocks=self.stored_blocks,
        )


class Flushed(NamedTuple):
    sent: int  # messages the ring took (a Stats included)
    gone: bool  # the ring's reader is gone (ActorDead): the caller gives the client up


@dataclass(slots=True)
class Outbox:
    """One client's output that its ring has not taken. Owned by the hub, in the engine's
    thread; never blocks: a send that finds the ring full leaves the rest queued."""

    max_queued: int  # messages queued before ``overflowed`` is set
    queue: deque[Queued] = field(default_factory=deque)  # oldest first
    open: dict[str, Queued] = field(default_factory=dict)  # request id -> its mergeable one
    overflowed: bool = False  # more than max_queued messages queued since the hub's last check
    stats: Stats | None = None  # the newest Stats not sent yet (never counted as queued)

    def put(self, out: Queued) -> None:
        """Queue ``out``, counted against ``max_queued``."""
        self.queue.append(out)
        if len(self.queue) > self.max_queued:
            self.overflowed = True

    def tokens_of(self, request_id: str, incarnation: int, num_tokens: int) -> Queued:
        """The queued Tokens of ``request_id`` that ``num_tokens`` more merge into: its open
        one while that stays within MAX_MERGED_TOKENS, else a new one, queued and open."""
        out = self.open.get(request_id)
        if out is None or len(out.token_ids) + num_tokens > MAX_MERGED_TOKENS:
            out = Queued(request_id=request_id, incarnation=incarnation)
            self.put(out)
            self.open[request_id] = out
        return out

    def held(self) -> int:
        """Messages held and not yet sent, a Stats included."""
        return len(self.queue) + (self.stats is not None)

    def clear(self) -> None:
        """Drop every queued message and the Stats held."""
        self.queue.clear()
        self.open.clear()
        self.stats = None

    def send_each(self, send: Callable[[object], object]) -> Flushed:
        """Send queued messages one by one, oldest first, then the Stats held, until the ring
        is full (``send`` raises RingFull) or its reader is gone (ActorDead)."""
        sent = 0
        while self.queue or self.stats is not None:
            out = self.queue[0] if self.queue else None
            try:
                send(out.message() if out is not None else self.stats)
            except RingFull:
                break
            except ActorDead:
                return Flushed(sent, gone=True)
            sent += 1
            if out is None:
                self.stats = None
                continue
            self.queue.popleft()
            if self.open.get(out.request_id) is out:
                del self.open[out.request_id]
        return Flushed(sent, gone=False)

    def send_batch(self, send_many: Callable[[list[object]], object]) -> Flushed:
        """Send what is queued (then the Stats held) with one ``send_many``, whose RingFull
        carries ``sent``: what went before. Those that did not go stay queued."""
        outs = list(self.queue)
        msgs: list[object] = [out.message() for out in outs]
        if self.stats is not None:
            msgs.append(self.stats)
        try:
            send_many(msgs)
            done = len(msgs)
        except RingFull as e:
            done = e.sent
        except ActorDead:
            return Flushed(0, gone=True)
        for out in outs[:done]:
            self.queue.popleft()
            if self.open.get(out.request_id) is out:
                del self.open[out.request_id]
        if done > len(outs):
            self.stats = None
        return Flushed(done, gone=False)

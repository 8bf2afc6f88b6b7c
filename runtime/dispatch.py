"""Dispatch: one message to its actor's handler, and what the handler's failure becomes.

This holds the runtime's only catch-all ``except``: a handler that raises is logged
(``msg.failed``), answered with :class:`~ringfence.runtime.messages.Failed` when the sender
expects a reply (its class sets ``expects_reply = True``) or the frame could not be decoded
at all, and reported to the actor's ``on_failure``; the actor lives on. A handler blocked
on a peer (:data:`BLOCKED`: a full ring, a dead peer, a watermark wait past its deadline)
fails nothing: the message is handed over again later (``msg.deferred``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from ringfence.runtime.messages import Failed
from ringfence.shm.errors import (
    ActorDead,
    ProtocolError,
    RingfenceError,
    RingFull,
    WaitTimeout,
)

if TYPE_CHECKING:
    from ringfence.runtime.actor import Actor
    from ringfence.runtime.log import ActorLog
    from ringfence.runtime.mailbox import Delivery, Outbox

# Raised from a handler, these mean "downstream is full or its process is down", not "this
# message is bad": the message is handed over again (after the other inboxes had a turn)
# rather than failed, so backpressure and a peer's restart lose nothing. Handlers are
# idempotent by their sequence numbers, so the part of the work already done is redone
# harmlessly.
# A full ring downstream, a dead peer, or a wait for another actor's watermark that ran
# past its deadline: not the message's fault, so it is handed over again later.
BLOCKED = (RingFull, ActorDead, WaitTimeout)
REPLY_TIMEOUT_S = 1.0  # how long an error reply may wait for room
ERROR_CHARS = 2000  # an error's text in a Failed reply and a msg.failed line is cut to this


def error_text(error: BaseException) -> str:
    """``str(error)``, cut to ``ERROR_CHARS``: an error about a peer's frame may quote the
    frame, which can be as long as the ring allows, and the reply must fit the peer's ring."""
    text = str(error)
    if len(text) <= ERROR_CHARS:
        return text
    return f"{text[: ERROR_CHARS - 40]}... ({len(text)} characters in all)"


class Dispatcher:
    """Hands deliveries to one actor's handler table and answers the handlers' failures.

    Owned by the actor's :class:`~ringfence.runtime.driver.Driver` and used from its loop
    thread only. ``outboxes`` is the mailbox's own table (read at each failure, so an outbox
    added later is answered through); failure answers are sent on it, the counters below
    are mutated, and the actor's ``on_failure`` is called; nothing else is.
    """

    def __init__(
        self,
        *,
        instance: str,
        actor: Actor,
        table: Mapping[type, Callable[[object], object]],
        outboxes: Mapping[str, Outbox],
        log: ActorLog,
    ) -> None:
        self._instance = instance  # names this actor in a "no handler" error
        self._actor = actor
        self._table = table
        self._outboxes = outboxes
        self._log = log
        self.current: Delivery | None = None  # the delivery whose handler runs now
        self.handled = 0  # messages handed to a handler (failed ones included)
        self.failures = 0  # handlers that raised, and frames that could not be decoded
        self.deferred = 0  # messages handed over again because a send or wait was blocked

    def handles(self, cls: type) -> bool:
        """Whether the actor has a handler for messages of class ``cls``."""
        return cls in self._table

    def dispatch(self, delivery: Delivery) -> bool:
        """Hand one message to its handler. False: it must be handed over again later."""
        self.handled += 1
        msg = delivery.msg
        if msg is None:
            assert delivery.error is not None
            self._failed(delivery, delivery.error)
            return True
        if self._log.tracing:
            self._log.trace(
                "msg.recv", peer=delivery.peer, seq=delivery.seq, type=type(msg).__name__
            )
        self.current = delivery
        try:
            handler = self._table.get(type(msg))
            if handler is None:
                raise ProtocolError(f"{self._instance}: no handler for {type(msg).__name__}")
            handler(msg)
        except BLOCKED as e:  # blocked on a peer: not this message's fault
            self.deferred += 1
            self._log.warning(
                "msg.deferred",
                peer=delivery.peer,
                seq=delivery.seq,
                type=type(msg).__name__,
                error=type(e).__name__,
                message=str(e),
            )
            return False
        except Exception as e:  # the one catch-all: a failed handler becomes a reply and a log
            self._failed(delivery, e)
        finally:
            self.current = None
        return True

    def _failed(self, delivery: Delivery, error: Exception) -> None:
        self.failures += 1
        msg = delivery.msg
        type_name = type(msg).__name__ if msg is not None else _undecoded(error)
        replied = False
        wants_reply = msg is None or getattr(type(msg), "expects_reply", False)
        outbox = self._outboxes.get(delivery.peer)
        text = error_text(error)
        if wants_reply and outbox is not None and not isinstance(msg, Failed):
            reply = Failed(
                seq=delivery.seq, type=type_name, error=type(error).__name__, message=text
            )
            try:
                outbox.send(reply, REPLY_TIMEOUT_S)
                replied = True
            except (RingfenceError, ValueError) as e:  # ring full, peer gone, reply too big
                self._log.warning(
                    "msg.reply_lost", peer=delivery.peer, seq=delivery.seq, error=repr(e)
                )
        self._log.error(
            "msg.failed",
            peer=delivery.peer,
            seq=delivery.seq,
            type=type_name,
            error=type(error).__name__,
            message=text,
            replied=replied,
            exc_info=error if msg is not None else None,
        )
        self._actor.on_failure(error, delivery)


def _undecoded(error: Exception) -> str:
    tag = getattr(error, "tag", None)
    return f"tag {tag}" if tag is not None else "undecodable"

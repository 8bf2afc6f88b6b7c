"""The engine's side of prefill/decode disaggregation: reservations and held finishes.

docs/design.md, "Instances (prefill/decode disaggregation)". A decode instance
(``engine.role = "decode"``) grants :class:`Reserve` requests from the scheduler's rule
(:mod:`ringfence.sched.reservations`), answers each with a :class:`Reservation`, and expires
the unclaimed ones on its own timer (an :class:`Expire` message,
``engine.reservation_ttl_s`` after the grant). A prefill instance (``"prefill"``) holds each
finished request's finish until the store op that writes its last block (``HandOver.mark``)
is complete on every rank, then ends it with the number of leading blocks storage holds:
once the client hears the finish, those blocks are whole and visible to any instance on the
same tier.

Owned by the Engine actor, called from its handlers; never blocks.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from ringfence.actors.engine.clients import ClientHub, RequestRefused
from ringfence.actors.engine.config import EngineConfig
from ringfence.actors.engine.outputs import Outputs
from ringfence.actors.protocol.client import Reservation, Reserve, Submit
from ringfence.runtime.log import ActorLog
from ringfence.sched.reservations import Refusal
from ringfence.sched.scheduler import Scheduler
from ringfence.sched.sequence import HandOver

ROLE_CODE = "role"  # Rejected.code: not what this instance's role takes
RESERVATION_CODE = "reservation"  # Rejected.code: the claim's reservation is not live


@dataclass(frozen=True, slots=True)
class Expire:
    """Timer: reservation ``key`` is due to expire (if still unclaimed)."""

    key: str


class HandOverDesk:
    """See the module docstring. ``schedule(delay_s, msg)`` is the engine's timer."""

    def __init__(
        self,
        engine: EngineConfig,
        clients: ClientHub,
        outputs: Outputs,
        log: ActorLog,
        schedule: Callable[[float, object], None],
        *,
        now: Callable[[], float],
    ) -> None:
        self.role, self.ttl_s = engine.role, engine.reservation_ttl_s
        self._clients, self._outputs, self._log = clients, outputs, log
        self._schedule, self._now = schedule, now
        self._held: list[tuple[HandOver, float]] = []  # with when it was held

    # Decode: reservations.

    def reserve(self, peer: str, msg: Reserve, scheduler: Scheduler | None) -> None:
        """Answer ``peer``'s Reserve: granted, or why not (with ``retry`` when it may fit
        later); a granted one expires ``ttl_s`` from now unless claimed."""
        key = self._clients.scoped(peer, msg.reservation_id)
        if key is None:
            return  # no Hello from it, or it is gone: nobody to answer
        if self.role != "decode":
            why = f"engine.role is {self.role!r}: only a decode instance grants reservations"
            self._refuse(peer, key, msg, why, retry=False)
            return
        if scheduler is None:
            self._refuse(peer, key, msg, "the engine is starting", retry=True)
            return
        expires = self._now() + self.ttl_s
        answer = scheduler.reserve(key, msg.prompt_token_ids, msg.max_tokens, expires)
        if isinstance(answer, Refusal):
            self._refuse(peer, key, msg, answer.reason, retry=answer.retry)
            return
        self._schedule(self.ttl_s, Expire(key))
        free = scheduler.blocks.device.num_free
        self._log.info(
            "reservation.grant",
            reservation=key,
            prompt_tokens=len(msg.prompt_token_ids),
            max_tokens=msg.max_tokens,
            blocks=answer.blocks,
            ttl_s=self.ttl_s,
            free_blocks=free,
            headroom=free - scheduler.reservations.num_blocks,
        )
        granted = Reservation(
            reservation_id=msg.reservation_id,
            incarnation=0,
            granted=True,
            ttl_s=self.ttl_s,
            blocks=answer.blocks,
        )
        self._clients.answer_reservation(peer, granted)

    def _refuse(self, peer: str, key: str, msg: Reserve, why: str, *, retry: bool) -> None:
        self._log.info(
            "reservation.refuse",
            reservation=key,
            prompt_tokens=len(msg.prompt_token_ids),
            error=why,
            retry=retry,
        )
        refused = Reservation(
            reservation_id=msg.reservation_id, incarnation=0, granted=False, error=why, retry=retry
        )
        self._clients.answer_reservation(peer, refused)

    def expire(self, msg: Expire, scheduler: Scheduler | None) -> None:
        if scheduler is None:
            return
        dropped = scheduler.reservations.expire(msg.key, self._now())
        if dropped is not None:
            self._log.warning("reservation.expire", reservation=msg.key, blocks=dropped.blocks)

    def claimed(self, peer: str, msg: Submit, scheduler: Scheduler) -> str:
        """The engine-wide key of the live reservation ``msg`` claims ("" if it claims none);
        RequestRefused with its code if its role or reservation does not let it run here:
        a decode instance takes only claims of live reservations, others no claim."""
        if self.role == "decode" and not msg.reservation_id:
            raise RequestRefused(
                "this is a decode instance (engine.role): it takes requests only with a "
                "reservation, through 'ringfence router'",
                ROLE_CODE,
            )
        if not msg.reservation_id:
            return ""
        if self.role != "decode":
            raise RequestRefused(
                f"engine.role is {self.role!r}: only a decode instance takes reservations",
                ROLE_CODE,
            )
        key = self._clients.scoped(peer, msg.reservation_id)
        if key is None or key not in scheduler.reservations.live:
            raise RequestRefused(
                f"reservation {msg.reservation_id!r} expired or was never granted "
                "(engine.reservation_ttl_s)",
                RESERVATION_CODE,
            )
        return key

    # Prefill: held finishes.

    def hold(self, handovers: list[HandOver]) -> None:
        """The requests the scheduler handed over: their finishes wait for their writes."""
        now = time.perf_counter()
        for handover in handovers:
            self._held.append((handover, now))
            self._log.info(
                "handover.hold",
                request=handover.request_id,
                blocks=len(handover.keys),
                store_op=handover.mark,
            )

    def settle(self, store_complete: int, scheduler: Scheduler) -> None:
        """End every held request whose writes are complete (store op ``store_complete``
        and every one before it are complete on every rank)."""
        if not self._held:
            return
        waiting = []
        for handover, since in self._held:
            if handover.mark > store_complete:
                waiting.append((handover, since))
                continue
            stored = scheduler.handovers.stored_blocks(handover)
            self._log.info(
                "handover.done",
                request=handover.request_id,
                blocks=len(handover.keys),
                stored_blocks=stored,
                wait_ms=round((time.perf_counter() - since) * 1e3, 3),
            )
            self._outputs.finished(handover.request_id, "", stored_blocks=stored)
        self._held = waiting

    @property
    def holding(self) -> bool:
        return bool(self._held)

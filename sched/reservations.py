"""Decode-side reservations: room promised to a request before its prefill runs elsewhere.

A decode instance (``engine.role = "decode"``) takes requests only by reservation
(docs/design.md, "Instances (prefill/decode disaggregation)"): the router asks it for room,
then has the prompt prefilled on a prefill instance, then claims the room with the request.
A reservation is granted only when the request's blocks fit beside the headroom kept for the
growth of the requests the instance already has (``sched.reserve_blocks``), so a new request
never makes a running one preempted, whatever arrives. An unclaimed reservation expires at
the time the caller gave (the engine's timer); nothing else frees it.

What a request is counted for:

- with ``reserve_blocks = -1`` (the default), its whole life: the blocks of its prompt
  plus ``max_tokens``. A live request's headroom is what it may still grow into (its life
  less the device blocks it holds); the sum of every commitment never exceeds the pool,
  so no admission or growth ever runs out of blocks;
- with ``reserve_blocks = R >= 0``, a reservation counts its prompt and first token only,
  and the live requests' headroom is capped at ``R`` blocks: more requests fit, and a
  request that outgrows the headroom preempts (by ``save`` on a decode instance).

Pure: no clock, no I/O; owned by the scheduler; not thread-safe.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    """Room held for one request until it is claimed or expires."""

    reservation_id: str  # the engine's key: unique among live reservations
    prompt_token_ids: tuple[int, ...]  # the claim must bring exactly these
    max_tokens: int
    blocks: int  # device blocks counted for it (see the module docstring)
    expires_at: float  # on the caller's clock


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a reservation was not granted; ``retry``: it may fit later (no room now)."""

    reason: str
    retry: bool


class Reservations:
    """The live reservations of one scheduler and the rule that grants them."""

    def __init__(self, block_size: int, reserve_blocks: int) -> None:
        if reserve_blocks < -1:
            raise ValueError(f"sched.reserve_blocks must be >= -1, got {reserve_blocks}")
        self._bs = block_size
        self.reserve_blocks = reserve_blocks
        self.live: dict[str, Reservation] = {}

    def blocks_for(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The blocks a reservation of this request is counted for."""
        tokens = num_prompt_tokens + (max_tokens if self.reserve_blocks < 0 else 1)
        return -(-tokens // self._bs)

    def growth(self, lives: Iterable[tuple[int, int, int]]) -> int:
        """The headroom kept for live requests, given (prompt tokens, max_tokens, device
        blocks held) of each: what they may still grow into, capped at ``reserve_blocks``
        when that is not -1."""
        total = 0
        for prompt, max_tokens, held in lives:
            total += max(0, -(-(prompt + max_tokens) // self._bs) - held)
        return total if self.reserve_blocks < 0 else min(total, self.reserve_blocks)

    @property
    def num_blocks(self) -> int:
        """Blocks counted for every live reservation."""
        return sum(r.blocks for r in self.live.values())

    def grant(
        self,
        reservation_id: str,
        prompt_token_ids: tuple[int, ...],
        max_tokens: int,
        *,
        free_blocks: int,
        headroom: int,
        expires_at: float,
    ) -> Reservation | Refusal:
        """A reservation if its blocks fit in ``free_blocks`` beside ``headroom`` and the live
        reservations; else why not. Records the reservation granted."""
        if reservation_id in self.live:
            return Refusal(f"reservation {reservation_id!r} is already live", retry=False)
        need = self.blocks_for(len(prompt_token_ids), max_tokens)
        room = free_blocks - headroom - self.num_blocks
        if need > room:
            return Refusal(
                f"no room: the request needs {need} blocks; {free_blocks} are free, "
                f"{headroom} kept for running requests' growth (sched.reserve_blocks), "
                f"{self.num_blocks} reserved for {len(self.live)} unclaimed reservations",
                retry=True,
            )
        reservation = Reservation(
            reservation_id=reservation_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=max_tokens,
            blocks=need,
            expires_at=expires_at,
        )
        self.live[reservation_id] = reservation
        return reservation

    def claim(
        self, reservation_id: str, prompt_token_ids: tuple[int, ...], max_tokens: int
    ) -> Reservation:
        """Take a live reservation for its request; KeyError if it is not live (expired,
        claimed or never granted), ValueError (it stays live) if the request is not the one
        reserved: other prompt tokens, or more max_tokens."""
        reservation = self.live[reservation_id]
        if prompt_token_ids != reservation.prompt_token_ids:
            raise ValueError(
                f"reservation {reservation_id!r} was made for another prompt "
                f"({len(reservation.prompt_token_ids)} tokens, not {len(prompt_token_ids)} "
                "or not the same ones)"
            )
        if max_tokens > reservation.max_tokens:
            raise ValueError(
                f"reservation {reservation_id!r} holds room for max_tokens "
                f"{reservation.max_tokens}, the request asks {max_tokens}"
            )
        return self.live.pop(reservation_id)

    def expire(self, reservation_id: str, now: float) -> Reservation | None:
        """Drop the reservation if it is live and due by ``now``; the one dropped, or None."""
        reservation = self.live.get(reservation_id)
        if reservation is None or reservation.expires_at > now:
            return None
        return self.live.pop(reservation_id)

"""One request's run over the instances: reserve on a decode instance, prefill on a prefill
instance, claim on the decode instance (the contract: docs/design.md,
"Instances (prefill/decode disaggregation)").

1. Reserve: the decode instance picked by load; on ``503 no_room`` (or one unreachable)
   the other decode instances, then a wait (Retry-After, at least the backoff that doubles
   each round, at most ``retry_cap_s``) and another round, until ``reserve_timeout_s``:
   then 503 with Retry-After. A 400 (the client's body is bad) reaches the client as is.
   Under the cache policy, where instances publish KV events, the decode instance tried
   first is the one the cost function picks for the prompt (``policy.py``: what it holds
   of it, against its load).
2. Prefill: the prefill instance picked by load (under the cache policy, by the cost
   function over the reservation's token ids; none at all when the decode instance holds
   every full block of the prompt), with the reservation's token ids, within
   the prefill deadline. Any failure is logged and counted, and the request goes on: the
   decode instance computes what the shared tier lacks.
3. Claim: the client's body, byte for byte, with the reservation header. An expired
   reservation is reserved again (the same instance preferred) and claimed again.

The router counts a request in flight on its decode instance from the reserve call to the
end of the answer's relay, and on its prefill instance during the prefill. Under the cache
policy its prompt counts in flight there over the same spans (``Picker.sent`` to
``Picker.ended``), so the next request of its prefix, sent before any event says where its
blocks are, is scored as cached where they are being computed; whether to skip the
prefill is read from the events alone.
"""

from __future__ import annotations

import asyncio
import math
import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import orjson

from ringfence.actors.http.errors import ApiError
from ringfence.actors.router.instances import Instance
from ringfence.actors.router.keys import keys_of, prompt_keys, salt_of
from ringfence.actors.router.options import FIRST_BACKOFF_S
from ringfence.actors.router.policy import Choice
from ringfence.actors.router.state import Router
from ringfence.actors.router.upstream import (
    JSON,
    Answer,
    ConnectError,
    Stream,
    TransportError,
    describe,
)
from ringfence.cache.ids import BlockHash
from ringfence.shm.errors import RingfenceError

RESERVATION_HEADER = "X-Ringfence-Reservation"
CHOICE_HEADER = "X-Ringfence-Choice"  # the choice of an n > 1 request a claim runs
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
RESERVE_CALL_S = 5.0  # one reserve call (the reserve deadline bounds it too)
# Between two bytes of a claim's answer: a plain answer's first byte comes when the whole
# output is made, so this bounds the longest generation (the instance has its own limit).
CLAIM_READ_S = 600.0
CLAIM_CONNECT_S = 5.0


class Relayed(RingfenceError):
    """An instance's error answer that the client gets as is (a 400 naming its field)."""

    def __init__(self, answer: Answer | Stream, content: bytes) -> None:
        super().__init__(f"HTTP {answer.status} from {answer.url}")
        self.status = answer.status
        self.content = content
        self.media_type = answer.headers.get("content-type", "application/json")
        after = answer.headers.get("retry-after")
        self.headers = {"Retry-After": after} if after is not None else {}


@dataclass(frozen=True, slots=True, kw_only=True)
class Reservation:
    """Room on a decode instance for one request, until its ttl_s runs out."""

    instance: Instance
    id: str
    ttl_s: float
    prompt_token_ids: list[int]


@dataclass(frozen=True, slots=True)
class Refusal:
    """A reserve call that got no reservation (no room, or the instance failed)."""

    why: str
    retry_after_s: float | None = None


def error_code(content: bytes) -> str | None:
    """``error.code`` of an OpenAI error body, or None."""
    try:
        code = orjson.loads(content)["error"]["code"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    return code if isinstance(code, str) else None


def retry_after_s(answer: Answer) -> float | None:
    try:
        return max(float(answer.headers["retry-after"]), 0.0)
    except (KeyError, ValueError):
        return None


def decode_lost(router: Router, request: str, where: str | None, error: str, what: str) -> ApiError:
    """The 502 of an instance (``what``: "decode instance", "instance") that failed after
    its answer began, logged as ``router.decode_lost``."""
    router.log.error("router.decode_lost", request=request, decode=where, error=error)
    return ApiError(
        f"the {what} {where} failed: {error}",
        status=502, kind="server_error", code="decode_failed",
    )  # fmt: skip


class Handover:
    """One request's run. On the router's event loop: :meth:`run` once, then the answer's
    relay, then :meth:`finish` once (also after a failure or a cancellation)."""

    def __init__(
        self, router: Router, kind: str, body: bytes, request: dict[str, Any], request_id: str,
        *, choice: int = 0,
    ) -> None:  # fmt: skip
        self.router = router
        self.kind = kind
        self.body = body  # the client's body as sent
        self.request = request  # ... and parsed (once, on arrival)
        self.id = request_id
        self.choice = choice  # of an n > 1 request, each choice claimed alone (choices.py)
        self.started = time.monotonic()
        self.upstream: Stream | None = None  # the claim's answer being relayed
        self.held: list[Instance] = []  # decode instances this request counts in flight on
        # The prompt's keys as the decode picker scored them (cache policy; set before the
        # first reserve): its prompt counts in flight with them where it is held.
        self.keys: list[BlockHash] = []
        self.trace: dict[str, Any] = {"retries": 0, "claims": 0, "decode": None, "prefill": None}
        self._claimed_at = 0.0
        self._finished = False

    # The run.

    async def run(self, *, prefill: bool = True, prefer: Instance | None = None) -> Stream:
        """The claim's answer (status 200, body unread), once reserved (on ``prefer``
        first, else the one :meth:`cached_decode` picks) and prefilled (unless ``prefill``
        is False: a later choice of a request whose first one prefilled the prompt).

        Raises ApiError (503: no room in time; 502: the decode instance failed before its
        answer began) or Relayed (an instance's own error answer, for the client as is).
        """
        reservation = await self.reserve(prefer=prefer or await self.cached_decode())
        if prefill:
            await self.prefill(reservation)
        return await self.claimed(reservation)

    async def claimed(self, reservation: Reservation) -> Stream:
        """The answer to the claim of ``reservation``, reserving again while it expired."""
        for _ in range(self.router.options.max_claims):
            answer = await self.claim(reservation)
            if answer is not None:
                return answer
            reservation = await self.reserve(prefer=reservation.instance)
        raise ApiError(
            f"the reservation on {reservation.instance.url} expired "
            f"{self.router.options.max_claims} times before its claim",
            status=503, kind="server_error", code="reservation_expired",
            headers={"Retry-After": "1"},
        )  # fmt: skip

    async def cached_decode(self) -> Instance | None:
        """Under the cache policy, where decode instances publish events: the decode
        instance the cost function picks for the prompt (what it holds of it against its
        load), tried first; else None (the least in flight)."""
        pick = self.router.pd.get("decode")
        if pick is None or not any(i.identity.events for i in pick.instances):
            return None
        keys = await prompt_keys(self.router.client, self.kind, self.request, pick.instances)
        choice = pick.choose(keys)
        if choice is None:
            return None
        self.keys = keys
        self.trace["prompt_blocks"], self.trace["decode_cached"] = len(keys), choice.cached
        return choice.instance

    async def reserve(self, prefer: Instance | None) -> Reservation:
        """A reservation on a decode instance (``prefer`` first), waiting for room."""
        router, options = self.router, self.router.options
        start = time.monotonic()
        deadline = start + options.reserve_timeout_s
        payload = b'{"kind":"%s","body":%s}' % (self.kind.encode(), self.body)
        wait, tried, last = FIRST_BACKOFF_S, set[Instance](), Refusal("no answer")
        asked = 0
        while True:
            instance = router.pool.pick("decode", exclude=frozenset(tried), prefer=prefer)
            left = deadline - time.monotonic()
            if instance is None or (asked and left <= 0):
                if left <= 0:
                    raise self._no_room(last, options.reserve_timeout_s)
                pause = max(wait, last.retry_after_s or 0.0)
                await asyncio.sleep(min(pause, options.retry_cap_s, left))
                wait, tried = min(wait * 2, options.retry_cap_s), set()
                continue
            if asked:
                router.metrics.reserve_retries.inc()
                self.trace["retries"] += 1
            asked += 1
            tried.add(instance)
            got = await self._reserve_on(instance, payload, left)
            if isinstance(got, Reservation):
                router.metrics.stage_seconds.labels(stage="reserve").observe(
                    time.monotonic() - start
                )
                self.trace["decode"] = instance.url
                return got
            last = got

    async def _reserve_on(
        self, instance: Instance, payload: bytes, left: float
    ) -> Reservation | Refusal:
        """One reserve call; the request counts in flight on ``instance`` if it is granted."""
        self._hold(instance)
        try:
            answer = await self.router.client.post(
                f"{instance.url}/ringfence/reserve",
                payload,
                timeout=max(min(RESERVE_CALL_S, left), 0.01),
            )
        except TransportError as e:
            self._release(instance)
            error = describe(e)
            self.router.log.warning(
                "router.reserve_failed", request=self.id, decode=instance.url, error=error
            )
            return Refusal(f"{instance.url} failed: {error}")
        if answer.status == 200:
            try:
                got = orjson.loads(answer.content)
                return Reservation(
                    instance=instance,
                    id=str(got["reservation_id"]),
                    ttl_s=float(got["ttl_s"]),
                    prompt_token_ids=[int(t) for t in got["prompt_token_ids"]],
                )
            except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                error = f"not a reservation ({e!r}): {answer.text[:200]}"
        else:
            error = f"HTTP {answer.status}: {answer.text[:200]}"
        self._release(instance)
        if answer.status == 400:
            raise Relayed(answer, answer.content)
        if answer.status == 503:
            return Refusal(f"{instance.url}: {error}", retry_after_s(answer))
        self.router.log.warning(
            "router.reserve_failed", request=self.id, decode=instance.url, error=error
        )
        return Refusal(f"{instance.url}: {error}")

    def _no_room(self, last: Refusal, timeout_s: float) -> ApiError:
        after = str(max(1, math.ceil(last.retry_after_s or 1.0)))
        self.router.log.warning(
            "router.gave_up", request=self.id, waited_s=timeout_s, last=last.why,
            retries=self.trace["retries"],
        )  # fmt: skip
        return ApiError(
            f"no decode instance had room for the request within {timeout_s:g} s "
            f"(last: {last.why})",
            status=503, kind="server_error", code="no_room", headers={"Retry-After": after},
        )  # fmt: skip

    async def prefill(self, reservation: Reservation) -> None:
        """Prefill the reservation's prompt into the shared tier, or log why not."""
        router = self.router
        keys = []  # the prompt's block keys, under the cache policy
        salt = salt_of(self.request)
        if "prefill" in router.pd:
            keys = keys_of(reservation.instance.identity, reservation.prompt_token_ids, salt)
        if self._held_by_decode(reservation, keys):
            self.trace["prefill_skipped"] = True
            return
        instance = self._prefill_instance(keys)
        if instance is None:
            self._fell_back("no_instance", None, "no prefill instance", reservation)
            return
        pick = router.pd.get("prefill")
        # Its prompt counts in flight there until the prefill ends, however it ends: the
        # next prompt of its prefix finds the blocks being computed there (policy.py).
        flight: AbstractContextManager[object] = nullcontext()
        if pick is not None:
            flight = pick.flight(Choice(instance), keys)
        self.trace["prefill"] = instance.url
        timeout = router.options.prefill_deadline_s(reservation.ttl_s)
        start = time.monotonic()
        body: dict[str, Any] = {
            "prompt_token_ids": reservation.prompt_token_ids,
            "request_id": self.id,
        }
        if salt:  # keyed as the decode side will key them
            body["cache_salt"] = salt
        with router.pool.busy(instance), flight:
            try:
                async with asyncio.timeout(timeout):  # the whole call, not each read
                    answer = await router.client.post(
                        f"{instance.url}/ringfence/prefill", orjson.dumps(body), timeout=timeout
                    )
            except ConnectError as e:
                return self._fell_back("refused", instance, repr(e), reservation)
            except TimeoutError:  # asyncio's, or the call's own (CallTimeout)
                why = f"no answer within {timeout:g} s"
                return self._fell_back("timeout", instance, why, reservation)
            except TransportError as e:
                return self._fell_back("transport", instance, repr(e), reservation)
        if answer.status != 200:
            error = f"HTTP {answer.status}: {answer.text[:200]}"
            return self._fell_back("http_error", instance, error, reservation)
        try:
            done = orjson.loads(answer.content)
            self.trace["stored_blocks"] = int(done["stored_blocks"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            error = f"not a prefill's answer ({e!r}): {answer.text[:200]}"
            return self._fell_back("bad_answer", instance, error, reservation)
        elapsed = time.monotonic() - start
        router.metrics.prefills.inc()
        router.metrics.stage_seconds.labels(stage="prefill").observe(elapsed)
        self.trace["prefill_s"] = round(elapsed, 6)

    def _held_by_decode(self, reservation: Reservation, keys: list[BlockHash]) -> bool:
        """Under the cache policy (``keys``: the prompt's): the decode instance holds every
        full block of the prompt already (on some tier), so no prefill is needed. Only what
        its events say counts, never a prompt in flight there (``Picker.flying``): that one's
        blocks may not be stored yet, and the claim would compute them again."""
        index = self.router.index
        if not keys or index is None:
            return False
        held = index.overlap(keys).get(reservation.instance.url)
        return held is not None and held.blocks == len(keys)

    def _prefill_instance(self, keys: list[BlockHash]) -> Instance | None:
        """The prefill instance: under the cache policy the one the cost function picks for
        the prompt's ``keys``, else the least in flight; None when there is none."""
        pick = self.router.pd.get("prefill")
        if pick is None:
            return self.router.pool.pick("prefill")
        choice = pick.choose(keys)
        if choice is None:
            return None
        self.trace["prefill_cached"] = choice.cached
        return choice.instance

    def _fell_back(
        self, why: str, instance: Instance | None, error: str, reservation: Reservation
    ) -> None:
        self.router.metrics.fallbacks.labels(why=why).inc()
        self.trace["fallback"] = why
        self.router.log.warning(
            "router.fell_back", request=self.id, why=why, error=error,
            prefill=instance.url if instance is not None else None,
            decode=reservation.instance.url, prompt_tokens=len(reservation.prompt_token_ids),
        )  # fmt: skip

    async def claim(self, reservation: Reservation) -> Stream | None:
        """The decode instance's answer to the claim (200, unread); None: it expired."""
        instance, router = reservation.instance, self.router
        self.trace["claims"] += 1
        self._claimed_at = time.monotonic()
        headers = {**JSON, RESERVATION_HEADER: reservation.id}
        if self.choice:
            headers[CHOICE_HEADER] = str(self.choice)
        try:
            answer = await router.client.open(
                instance.url + PATHS[self.kind],
                self.body,
                headers=headers,
                connect_s=CLAIM_CONNECT_S,
                read_s=CLAIM_READ_S,
            )
            if answer.status == 200:
                self.upstream = answer
                return answer
            content = await answer.read()
        except TransportError as e:
            raise self.decode_failed(describe(e)) from e
        if answer.status == 409 and error_code(content) == "reservation_expired":
            router.metrics.expired.inc()
            router.log.info(
                "router.expired", request=self.id, decode=instance.url, reservation=reservation.id
            )
            self._release(instance)
            return None
        raise Relayed(answer, content)

    # The answer.

    def first_byte(self) -> None:
        """The claim's answer began (its first body bytes arrived)."""
        elapsed = time.monotonic() - self._claimed_at
        self.router.metrics.stage_seconds.labels(stage="claim_to_first_byte").observe(elapsed)
        self.trace["first_byte_s"] = round(elapsed, 6)

    def decode_failed(self, error: str) -> ApiError:
        """The error of a decode instance that failed mid-request (logged here)."""
        return decode_lost(self.router, self.id, self.trace["decode"], error, "decode instance")

    async def finish(self, outcome: str, status: int, *, counted: bool = True) -> None:
        """Close the upstream answer, stop counting the request in flight, count (unless
        not ``counted``: a request's later choice) and log its outcome. Idempotent: the
        first call counts."""
        if self._finished:
            return
        self._finished = True
        if self.upstream is not None:
            await self.upstream.aclose()  # mid-stream: the decode instance aborts it
        while self.held:
            self._release(self.held[-1])
        if counted:
            self.router.metrics.requests.labels(outcome=outcome).inc()
        total, trace = round(time.monotonic() - self.started, 6), self.trace
        self.router.log.info(
            "router.answered", request=self.id, kind=self.kind, outcome=outcome, status=status,
            total_s=total, decode=trace["decode"], prefill=trace["prefill"],
            retries=trace["retries"], claims=trace["claims"], fallback=trace.get("fallback"),
            prefill_s=trace.get("prefill_s"), stored_blocks=trace.get("stored_blocks"),
            first_byte_s=trace.get("first_byte_s"), prompt_blocks=trace.get("prompt_blocks"),
            decode_cached=trace.get("decode_cached"), prefill_cached=trace.get("prefill_cached"),
            prefill_skipped=trace.get("prefill_skipped", False),
        )  # fmt: skip

    def _hold(self, instance: Instance) -> None:
        """Count the request in flight on the decode ``instance`` (under the cache policy
        its prompt too: ``Picker.sent``) until :meth:`_release`."""
        self.router.pool.acquire(instance)
        self.held.append(instance)
        pick = self.router.pd.get("decode")
        if pick is not None:
            pick.sent(Choice(instance), self.keys)

    def _release(self, instance: Instance) -> None:
        self.held.remove(instance)
        self.router.pool.release(instance)
        pick = self.router.pd.get("decode")
        if pick is not None:
            pick.ended(Choice(instance), self.keys)

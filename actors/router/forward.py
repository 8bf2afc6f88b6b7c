"""One request sent to an aggregated instance (``ringfence router --instance``).

1. Keys, when the policy reads them (``approximate``, ``cache``): the prompt's block keys
   as the instances hash them (``keys.py``). A prompt that cannot be tokenized is routed
   without keys (by load).
2. The instance the policy chooses (``router/policy.py``); the client's body goes there
   byte for byte, and its answer comes back as the instance gives it (a stream relayed
   event by event, an error as is). An instance that cannot be reached is marked down (the
   policy routes around it and forgets what it held) and the next choice is tried.

The answer carries ``X-Ringfence-Instance``: the instance that served it. The request
counts as in flight on its instance from the moment it is sent until its answer's relay
ends (its prompt's keys with it: ``Picker.sent`` to ``Picker.ended``), and as not begun
(its prefill ahead of later prompts there: ``Instance.ahead_blocks``) until its first byte.
"""

from __future__ import annotations

import time
from typing import Any

from ringfence.actors.http.errors import ApiError
from ringfence.actors.router.flow import (
    CLAIM_CONNECT_S,
    CLAIM_READ_S,
    PATHS,
    Relayed,
    decode_lost,
)
from ringfence.actors.router.instances import Instance
from ringfence.actors.router.keys import prompt_keys
from ringfence.actors.router.policy import Choice
from ringfence.actors.router.state import Router
from ringfence.actors.router.upstream import JSON, Stream, TransportError
from ringfence.cache.ids import BlockHash

INSTANCE_HEADER = "X-Ringfence-Instance"


class Forward:
    """One request's run (as :class:`~.flow.Handover`: :meth:`run` once, the relay, then
    :meth:`finish` once)."""

    def __init__(
        self, router: Router, kind: str, body: bytes, request: dict[str, Any], request_id: str
    ) -> None:
        assert router.picker is not None
        self.router, self.picker = router, router.picker
        self.kind = kind
        self.body = body
        self.request = request  # the body parsed (once, on arrival)
        self.id = request_id
        self.started = time.monotonic()
        self.upstream: Stream | None = None
        self.choice: Choice | None = None
        self.first_byte_s: float | None = None
        self._ahead: Choice | None = None  # routed and not begun: counted in its ahead_blocks
        self._keys: list[BlockHash] | None = None  # the keys routed with self.choice, till it ends
        self._sent_at = 0.0
        self._finished = False

    async def run(self) -> Stream:
        """The chosen instance's answer (status 200, body unread); Relayed for its error
        answer, ApiError 503 when no instance can be reached."""
        keys = await self.keys() if self.picker.needs_keys else []
        tried: list[Instance] = []
        while True:
            choice = self.picker.choose(keys)
            if choice is None:
                raise ApiError(
                    f"no instance could be reached (tried {', '.join(i.url for i in tried)})",
                    status=503, kind="server_error", code="no_instance",
                )  # fmt: skip
            instance = choice.instance
            self.router.pool.acquire(instance)
            self.choice = choice
            self._sent_at = time.monotonic()
            # Counted as sent (its prompt in flight there, its prefill ahead) before the
            # answer's head comes back: requests chosen meanwhile must see it.
            self.picker.sent(choice, keys)
            self._keys = keys
            self._queue(choice)
            try:
                answer = await self.router.client.open(
                    f"{instance.url}{PATHS[self.kind]}", self.body, headers=JSON,
                    connect_s=CLAIM_CONNECT_S, read_s=CLAIM_READ_S,
                )  # fmt: skip
            except TransportError as e:
                self._begun()
                self.picker.ended(choice, keys)
                self._keys = None
                self.router.pool.release(instance)
                self.choice = None
                self.router.lost(instance, self.id, repr(e))
                tried.append(instance)
                continue
            self.picker.routed(choice, keys)
            if answer.status != 200:
                raise Relayed(answer, await answer.read())
            self.upstream = answer
            return answer

    async def keys(self) -> list[BlockHash]:
        """The prompt's block keys (none when it cannot be tokenized)."""
        up = [i for i in self.picker.instances if i.url not in self.picker.down]
        return await prompt_keys(self.router.client, self.kind, self.request, up)

    # The answer (the relay calls these).

    def first_byte(self) -> None:
        self.first_byte_s = round(time.monotonic() - self._sent_at, 6)
        self._begun()

    def _queue(self, choice: Choice) -> None:
        """Count the request's prefill ahead of later prompts on its instance."""
        self._ahead = choice
        choice.instance.unstarted += 1
        choice.instance.ahead_blocks += choice.need

    def _begun(self) -> None:
        """Its first byte came (or it ended): its prefill is no longer ahead."""
        choice, self._ahead = self._ahead, None
        if choice is not None:
            instance = choice.instance
            instance.unstarted -= 1
            # Sums of floats drift: none left, none ahead.
            instance.ahead_blocks = max(instance.ahead_blocks - choice.need, 0.0)
            if not instance.unstarted:
                instance.ahead_blocks = 0.0

    def decode_failed(self, error: str) -> ApiError:
        where = self.choice.instance.url if self.choice else None
        return decode_lost(self.router, self.id, where, error, "instance")

    async def finish(self, outcome: str, status: int) -> None:
        """Close the upstream answer, stop counting it in flight, count and log it once."""
        if self._finished:
            return
        self._finished = True
        self._begun()
        if self.upstream is not None:
            await self.upstream.aclose()
        choice = self.choice
        if choice is not None:
            self.router.pool.release(choice.instance)
            if self._keys is not None:
                self.picker.ended(choice, self._keys)
        self.router.metrics.requests.labels(outcome=outcome).inc()
        self.router.log.info(
            "router.routed", request=self.id, kind=self.kind, outcome=outcome, status=status,
            total_s=round(time.monotonic() - self.started, 6),
            instance=None if choice is None else choice.instance.url,
            policy=self.picker.policy,
            prompt_blocks=None if choice is None else choice.prompt_blocks,
            cached_blocks=None if choice is None else choice.cached,
            first_byte_s=self.first_byte_s,
        )  # fmt: skip

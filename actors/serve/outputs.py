"""One API request's run in the engine, as text and token deltas, and the usage it reports.

:class:`Generation` reads a :class:`~.gateway.RequestStream` until the request ends,
turning the engine's token messages into :class:`Delta` s (new text, new token ids, and
the finish reason on the last one), applying stop strings, recording the request's
latencies and token counts in the metrics, and ending the request in the engine when its
client stops reading (:meth:`Generation.close`, from a ``finally``).

Under stop strings a token's log probabilities go out with its text, not before: text that
could begin a stop string is held back, and so are its tokens' log probabilities, so that
a stop string's tokens, cut from the text, never reach the client in the log
probabilities either (``TextStream.tokens_released``). A request's prompt tokens are
counted in the metrics by its first choice alone (``count_prompt``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ringfence.actors.http.errors import ApiError
from ringfence.actors.protocol.client import Rejected, Tokens
from ringfence.actors.serve.gateway import Lost, RequestStream
from ringfence.actors.serve.metrics import Metrics
from ringfence.actors.serve.text import TextStream
from ringfence.sched.request import TIERS
from ringfence.sched.sampling import TokenLogprobs

# Rejected.code -> the API's error code (answered 409): the router reserves again on
# "reservation_expired".
REJECTED_CODES = {"reservation": "reservation_expired", "role": "wrong_role"}


@dataclass(frozen=True, slots=True)
class Delta:
    """What one engine message added to the output."""

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # set on the last delta: "stop" or "length"
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token id, when the request asked


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))

    def body(self) -> dict[str, Any]:
        """OpenAI's ``usage`` object, with the per-tier split in a ``ringfence`` field."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
            "ringfence": {"cached_tokens": dict(self.cached)},
        }


class Generation:
    """The output of one request, read once. Event-loop thread only."""

    def __init__(
        self,
        stream: RequestStream,
        *,
        prompt_tokens: int,
        decode: Callable[[Iterable[int]], str],
        stop: Sequence[str],
        metrics: Metrics,
        timeout_s: float,
        drop_output: bool = False,
        count_prompt: bool = True,
    ) -> None:
        self.stream = stream
        # max_tokens 0 (echo): the engine runs one token, which the answer leaves out.
        self._drop_output = drop_output
        # The prompt's log probabilities (from its second token), once the first Tokens came.
        self.prompt_logprobs: tuple[TokenLogprobs, ...] = ()
        self.usage = Usage(prompt_tokens)
        self.text = TextStream(decode, stop)
        # Under stop strings: every output token's log probabilities so far, and how many
        # went out (those of the tokens whose text did).
        self._follow_text = any(stop)
        self._logprobs: list[TokenLogprobs] = []
        self._logprobs_out = 0
        self._count_prompt = count_prompt  # False for a request's further choices
        self._metrics = metrics
        self._timeout_s = timeout_s
        self._last_token_at: float | None = None
        self.finish_reason: str | None = None

    async def deltas(self) -> AsyncIterator[Delta]:
        """The output as it comes; ApiError if the engine refused or lost the request."""
        while self.finish_reason is None:
            try:
                event = await self.stream.next(self._timeout_s)
            except TimeoutError:
                self._end("error")
                raise ApiError(
                    f"no output for {self._timeout_s} s (server.request_timeout_s)",
                    status=504,
                    kind="timeout",
                ) from None
            delta = self._take(event)
            if delta is not None:
                yield delta

    def close(self) -> None:
        """The reader is done (finished, failed or gone): free the request in the engine."""
        if not self.stream.done:
            self.stream.abort()
        if self.finish_reason is None:
            self._end("abort")

    def _take(self, event: Tokens | Rejected | Lost) -> Delta | None:
        if isinstance(event, Rejected | Lost):
            self._end("error")
            status = 400 if isinstance(event, Rejected) else event.status
            code = REJECTED_CODES.get(event.code) if isinstance(event, Rejected) else None
            status = 409 if code else status
            kind = "invalid_request_error" if status < 500 else "service_unavailable"
            raise ApiError(f"the engine could not run the request: {event.error}", status=status,
                           kind=kind, code=code)  # fmt: skip
        if event.error:
            self._end("error")
            raise ApiError(f"the request failed in the engine: {event.error}", status=500,
                           kind="server_error")  # fmt: skip
        if sum(event.cached_tokens.values()):
            self.usage.cached = {tier: event.cached_tokens.get(tier, 0) for tier in TIERS}
        if event.prompt_logprobs:
            self.prompt_logprobs = event.prompt_logprobs
        ids, logprobs = event.token_ids, event.logprobs
        if self._drop_output:
            ids, logprobs = (), ()
        self._observe(len(ids))
        text = self.text.add(ids)
        finish = event.finish_reason or None
        if self.text.stopped:
            finish = "stop"
            self.stream.abort()  # the rest is not wanted; the engine ends it with "abort"
        elif finish is not None:
            text += self.text.finish()
            if finish == "abort":  # ended by the engine without an error: it was stopping
                self._end("abort")
                raise ApiError("the request was aborted in the engine", status=503,
                               kind="service_unavailable")  # fmt: skip
        if finish is not None:
            self._end(finish)
        if self._follow_text:
            logprobs = self._with_text(logprobs, final=finish is not None)
        if not text and not ids and not logprobs and finish is None:
            return None
        return Delta(text, tuple(ids), finish, tuple(logprobs))

    def _with_text(
        self, logprobs: Sequence[TokenLogprobs], *, final: bool
    ) -> tuple[TokenLogprobs, ...]:
        """The log probabilities whose tokens' text went out by now (see the module
        docstring): all that are left at the end, but never a stop string's."""
        self._logprobs.extend(logprobs)
        upto = self.text.tokens_released()
        if final and not self.text.stopped:
            upto = len(self._logprobs)
        out = tuple(self._logprobs[self._logprobs_out : upto])
        self._logprobs_out = max(upto, self._logprobs_out)
        return out

    def _observe(self, count: int) -> None:
        if not count:
            return
        now = time.perf_counter()
        if self._last_token_at is None:
            self._metrics.ttft.observe(now - self.stream.opened)
        else:
            gap = (now - self._last_token_at) / count
            for _ in range(count):
                self._metrics.itl.observe(gap)
        self._last_token_at = now
        self.usage.completion_tokens += count
        self._metrics.generation_tokens.inc(count)

    def _end(self, reason: str) -> None:
        if self.finish_reason is not None:
            return
        self.finish_reason = reason
        m = self._metrics
        m.finished.labels(reason=reason).inc()
        if self._count_prompt:  # once a request, as its usage counts it
            m.prompt_tokens.inc(self.usage.prompt_tokens)
            for tier, count in self.usage.cached.items():
                m.cached_tokens.labels(tier=tier).inc(count)
        if self._last_token_at is not None:
            m.e2e.observe(self._last_token_at - self.stream.opened)

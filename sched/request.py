"""One request as the scheduler sees it: sampling parameters, lifecycle state, token counts.

Pure bookkeeping: no clock (arrival times are given by the caller), no I/O, no tensors.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ringfence.sched.checks import (
    RequestError,
    check_number,
    check_salt,
    check_token_ids,
    is_int,
)
from ringfence.sched.sampling import SamplingParams, TokenLogprobs

# Re-exported: a request's error and parameters are part of its vocabulary.
__all__ = [
    "TIERS",
    "TRANSITIONS",
    "FinishReason",
    "Request",
    "RequestError",
    "RequestState",
    "SamplingParams",
    "check_messages",
]  # fmt: skip

TIERS = ("device", "host", "storage")  # where a cached prompt token can come from


def check_messages(messages: object) -> tuple[dict[str, Any], ...]:
    """A chat's messages as a tuple of fresh dicts; RequestError (field ``messages``) naming
    the message that is not an object with non-empty string ``role`` and string ``content``."""
    if not isinstance(messages, list | tuple) or not messages:
        raise RequestError(
            f"messages must be a non-empty list of message objects, got {messages!r}",
            field="messages",
        )
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestError(
                f"messages[{index}] must be an object, got {message!r}", field="messages"
            )
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise RequestError(
                f"messages[{index}].role must be a non-empty string, got {role!r}",
                field="messages",
            )
        if not isinstance(content, str):
            raise RequestError(
                f"messages[{index}].content must be a string, got {content!r}", field="messages"
            )
    return tuple(dict(message) for message in messages)


class RequestState(enum.StrEnum):
    WAITING = "waiting"  # queued, no KV blocks held
    WAITING_FOR_PREFETCH = "waiting_for_prefetch"  # its prefix is being fetched from storage
    RUNNING = "running"  # in the batch, holding device blocks
    PREEMPTED = "preempted"  # taken out of the batch; its KV recomputed, swapped or saved
    FINISHED = "finished"  # stopped by a stop token or max_tokens (terminal)
    ABORTED = "aborted"  # cancelled by the client or the engine (terminal)


# The lifecycle as data, so the scheduler, the replay checker and the tests read one table.
# A prefetch that completes (or fails: its blocks are then recomputed) sends the request
# back to WAITING or straight to RUNNING; a preempted request resumes by running again
# (recompute, swap) or by prefetching its saved blocks first (save).
TRANSITIONS: Mapping[RequestState, frozenset[RequestState]] = MappingProxyType(
    {
        RequestState.WAITING: frozenset(
            {RequestState.WAITING_FOR_PREFETCH, RequestState.RUNNING, RequestState.ABORTED}
        ),
        RequestState.WAITING_FOR_PREFETCH: frozenset(
            {RequestState.WAITING, RequestState.RUNNING, RequestState.ABORTED}
        ),
        RequestState.RUNNING: frozenset(
            {RequestState.PREEMPTED, RequestState.FINISHED, RequestState.ABORTED}
        ),
        RequestState.PREEMPTED: frozenset(
            {RequestState.WAITING_FOR_PREFETCH, RequestState.RUNNING, RequestState.ABORTED}
        ),
        RequestState.FINISHED: frozenset(),
        RequestState.ABORTED: frozenset(),
    }
)


class FinishReason(enum.StrEnum):
    STOP = "stop"  # sampled a stop token
    LENGTH = "length"  # reached max_tokens
    ABORT = "abort"  # aborted


class Request:
    """The scheduler's record of one request, from arrival to finish or abort.

    Owned and mutated by one caller (the engine's scheduler); not thread-safe. The
    prompt is an immutable tuple copy; ``output_token_ids`` grows only through
    :meth:`append_output`, and the state changes only through :meth:`transition`,
    :meth:`append_output` and :meth:`abort`, which check the lifecycle table
    ``TRANSITIONS`` and raise RequestError, changing nothing, on an illegal move.
    """

    __slots__ = (
        "_num_computed_tokens",
        "arrival",
        "cache_salt",
        "cached_tokens",
        "finish_reason",
        "output_token_ids",
        "params",
        "prompt_logprobs",
        "prompt_token_ids",
        "request_id",
        "state",
    )

    def __init__(
        self,
        *,
        request_id: str,
        prompt_token_ids: tuple[int, ...] | list[int],
        params: SamplingParams | None = None,
        arrival: float = 0.0,
        cache_salt: str = "",
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(
                f"request_id must be a non-empty string, got {request_id!r}", field="request_id"
            )
        self.request_id = request_id
        self.prompt_token_ids = check_token_ids(
            "prompt_token_ids", prompt_token_ids, allow_empty=False
        )
        self.params = params if params is not None else SamplingParams()
        # Seconds since the workload started, given by the caller: sched reads no clock.
        self.arrival = check_number("arrival", arrival)
        # vLLM's cache_salt: joins the hash of the prompt's first block (cache/block_hash.py),
        # so requests with another salt share none of this one's blocks. "": no salt.
        self.cache_salt = check_salt(cache_salt)
        self.state = RequestState.WAITING
        self.output_token_ids: list[int] = []  # sampled tokens, in order
        self._num_computed_tokens = 0  # tokens (prompt, then output) whose KV is in the cache
        # Prompt tokens whose KV came from each tier instead of being computed.
        self.cached_tokens: dict[str, int] = dict.fromkeys(TIERS, 0)
        self.finish_reason: FinishReason | None = None
        # prompt_logprobs asked: position -> its TokenLogprobs, as the Worker reports them
        # (a recomputed prompt reports them again: the first stays); None once sent.
        self.prompt_logprobs: dict[int, TokenLogprobs] | None = (
            {} if self.params.prompt_logprobs is not None else None
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, state={self.state.value}, "
            f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
            f"computed={self._num_computed_tokens})"
        )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> tuple[int, ...]:
        """Prompt then output, as a new tuple: a snapshot the caller may keep."""
        return self.prompt_token_ids + tuple(self.output_token_ids)

    @property
    def num_computed_tokens(self) -> int:
        return self._num_computed_tokens

    @num_computed_tokens.setter
    def num_computed_tokens(self, value: int) -> None:
        # A count past the known tokens or below zero is a scheduler bug: raise, never clamp.
        if not is_int(value) or not 0 <= value <= self.num_tokens:
            raise RequestError(
                f"request {self.request_id!r}: num_computed_tokens must lie in "
                f"0..{self.num_tokens}, got {value!r}",
                field="num_computed_tokens",
            )
        self._num_computed_tokens = value

    @property
    def num_uncomputed_tokens(self) -> int:
        """Known tokens without KV yet: what the sequence could compute now."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) - self._num_computed_tokens

    def computed_one(self) -> None:
        """One more token counts as computed: the setter's rule, for the per-step path of two
        steps in flight (the count is an int already; only the bound can be broken)."""
        if self._num_computed_tokens >= self.num_tokens:
            raise RequestError(
                f"request {self.request_id!r}: num_computed_tokens must lie in "
                f"0..{self.num_tokens}, got {self._num_computed_tokens + 1}",
                field="num_computed_tokens",
            )
        self._num_computed_tokens += 1

    @property
    def remaining_prefill(self) -> int:
        """Tokens to compute before the next token can be decoded one at a time.

        Every known token without KV, except the newest output token, which is the
        input of the next decode step. Counts outputs too: after a recompute
        preemption the outputs are prefilled again along with the prompt.
        """
        decode_input = 1 if self.output_token_ids else 0
        return max(0, self.num_tokens - decode_input - self._num_computed_tokens)

    @property
    def is_finished(self) -> bool:
        """Finished or aborted: no transition leaves these states."""
        return not TRANSITIONS[self.state]

    def transition(self, to: RequestState) -> None:
        """Move to state ``to``; RequestError (state unchanged) if the table forbids it."""
        if to not in TRANSITIONS[self.state]:
            raise RequestError(
                f"request {self.request_id!r}: illegal transition {self.state.value} -> "
                f"{RequestState(to).value}",
                field="state",
            )
        self.state = to

    def append_output(self, token_id: int) -> FinishReason | None:
        """Record one sampled token; finish the request if it ends it.

        The token is kept even when it is a stop token. A stop token wins over
        max_tokens when both apply. Returns the finish reason, or None if the
        request goes on. Only a RUNNING request samples tokens.
        """
        if self.state is not RequestState.RUNNING:
            raise RequestError(
                f"request {self.request_id!r}: cannot append output in state {self.state.value}",
                field="state",
            )
        if not is_int(token_id) or token_id < 0:
            raise RequestError(
                f"request {self.request_id!r}: token id must be a non-negative int, "
                f"got {token_id!r}",
                field="token_id",
            )
        self.output_token_ids.append(token_id)
        # Before min_tokens outputs the Worker masks the stop tokens; a stop token that
        # comes anyway (none can) would not end the request early.
        params = self.params
        if token_id in params.stop_token_ids and len(self.output_token_ids) > params.min_tokens:
            reason = FinishReason.STOP
        elif len(self.output_token_ids) >= params.max_tokens:
            reason = FinishReason.LENGTH
        else:
            return None
        self.transition(RequestState.FINISHED)
        self.finish_reason = reason
        return reason

    def abort(self) -> None:
        """Abort from any live state; RequestError if already finished or aborted."""
        self.transition(RequestState.ABORTED)
        self.finish_reason = FinishReason.ABORT

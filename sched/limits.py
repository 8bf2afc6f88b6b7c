"""What a request must fit to ever run: the model's vocabulary, its length, the device pool.

A request that fails one of these checks is refused when it is added (or reserved),
before any token: it could never be scheduled, and waiting would not help. The check is
pure: it reads the scheduler's config and the request's numbers, nothing else.
"""

from __future__ import annotations

from ringfence.sched.config import SchedulerConfig
from ringfence.sched.request import RequestError


def check_fits(
    config: SchedulerConfig, request_id: str, prompt: tuple[int, ...], max_tokens: int
) -> None:
    """RequestError naming the field if a request of ``prompt`` and ``max_tokens`` can never
    run: a prompt token outside the vocabulary, a prompt plus max_tokens longer than
    ``max_model_len`` or than the whole device pool."""
    vocab = config.vocab_size
    bad = next((t for t in prompt if not 0 <= t < vocab), None)
    if bad is not None:  # the Worker would refuse the whole step that held it
        raise RequestError(
            f"request {request_id!r}: prompt token {bad} is outside the model's "
            f"vocabulary of {vocab}",
            field="prompt_token_ids",
        )
    longest = len(prompt) + max_tokens
    if longest > config.max_model_len:
        raise RequestError(
            f"request {request_id!r}: prompt ({len(prompt)} tokens) "
            f"plus max_tokens ({max_tokens}) is {longest} tokens, more than "
            f"max_model_len {config.max_model_len} (sched.max_model_len, by default "
            "the model's positions)",
            field="max_tokens",
        )
    blocks = -(-longest // config.tiers.block_size)
    if blocks > config.tiers.device_blocks:
        raise RequestError(
            f"request {request_id!r}: {longest} tokens need "
            f"{blocks} blocks, the device pool has "
            f"{config.tiers.device_blocks}",
            field="max_tokens",
        )

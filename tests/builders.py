"""Builders of the project's values for tests that need one with a few fields that matter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ringfence.sched.ops import Opening, Piece
from ringfence.sched.sampling import SamplingParams


def piece(
    token_ids: Sequence[int], start: int, block_table: Sequence[int], *, seq_id: int = 0
) -> Piece:
    """A step's piece that samples nothing (a test that runs the executor reads the logits)."""
    return Piece(
        seq_id=seq_id,
        token_ids=tuple(token_ids),
        start=start,
        block_table=tuple(block_table),
        sample=False,
    )


def opened(num_prompt_tokens: int = 1, **params: Any) -> Opening:
    """A sequence's opening (its first piece's), sampled by ``params`` (greedy by default)."""
    return Opening(params=SamplingParams(**params), num_prompt_tokens=num_prompt_tokens)

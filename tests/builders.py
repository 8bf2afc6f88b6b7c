"""Builders of the project's values for tests that need one with a few fields that matter."""

from __future__ import annotations

from collections.abc import Sequence

from ringfence.sched.ops import Piece


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

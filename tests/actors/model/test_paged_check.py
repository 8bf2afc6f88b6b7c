"""The paged executor's check of a step, what the other tests of a malformed step leave out."""

from __future__ import annotations

import pytest
import torch
from builders import piece

from ringfence.actors.model.decoder import Model
from ringfence.actors.model.paged import PagedExecutor, make_kv_cache
from ringfence.sched.ops import Piece

BLOCK_SIZE = 4
NUM_BLOCKS = 16
MODEL = Model.from_preset("tiny", torch.float32, 1)
EXECUTOR = PagedExecutor(MODEL, make_kv_cache(MODEL.config, NUM_BLOCKS, BLOCK_SIZE, MODEL.dtype))


def problem(check, pieces: list[Piece]) -> str:
    """What ``check`` says of the step: its ValueError's text, or "" when it passes."""
    try:
        check(pieces)
    except ValueError as e:
        return str(e)
    return ""


def test_two_tokens_that_would_write_one_kv_slot_are_refused_naming_it():
    # Two sequences share block 3 (a prefix) and both decode position 5: slot (3, 1).
    pieces = [piece([7], 5, [2, 3], seq_id=1), piece([8], 5, [0, 3], seq_id=2)]
    assert problem(EXECUTOR.check, pieces) == (
        "piece 1 writes KV slot (3, 1) that another token writes"
    )
    # One chunk whose table names the block it writes twice is refused before that.
    assert "names a block twice" in problem(EXECUTOR.check, [piece([1, 2, 3, 4, 5], 0, [6, 6])])


def test_an_empty_step_is_refused():
    with pytest.raises(ValueError, match="a step needs at least one piece"):
        EXECUTOR.check([])

"""The step check keeps each sequence's last valid table and checks only what a table adds
to it: every verdict equals that of a check that keeps nothing."""

from __future__ import annotations

import random

import pytest
from builders import piece

from ringfence.actors.model.step_check import StepChecker
from ringfence.sched.ops import Piece

BLOCK_SIZE, NUM_BLOCKS, MAX_POSITION, VOCAB = 4, 64, 512, 100


def checker() -> StepChecker:
    return StepChecker(
        block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_position=MAX_POSITION, vocab=VOCAB
    )


def verdict(check: StepChecker, pieces: list[Piece]) -> str:
    try:
        check.check(pieces)
    except ValueError as e:
        return str(e)
    return ""


def decode(seq_id: int, table: list[int]) -> Piece:
    """A decode of the position after the table's last whole block but one slot."""
    return piece([1], len(table) * BLOCK_SIZE - 1, table, seq_id=seq_id)


def test_a_table_that_adds_a_block_it_already_names_is_refused():
    check = checker()
    check.check([decode(1, [3, 4])])
    assert verdict(check, [decode(1, [3, 4, 9, 3])]) == "block table of piece 0 names a block twice"
    assert verdict(check, [decode(1, [3, 4, 9, 9])]) == "block table of piece 0 names a block twice"
    assert verdict(check, [decode(1, [3, 4, 64])]) == (
        "block id 64 of piece 0 is outside the KV tensor's 64 blocks"
    )
    assert verdict(check, [decode(1, [3, 4, 9])]) == ""  # what was refused kept nothing


def test_an_ended_sequence_is_forgotten_and_a_full_pool_of_kept_tables_starts_over():
    check = checker()
    check.check([decode(1, [3]), decode(2, [5])])
    check.forget([1, 7])
    assert set(check._valid) == {2}
    for seq_id in range(3, 3 + NUM_BLOCKS):  # more sequences than blocks, none closed
        check.check([decode(seq_id, [seq_id % NUM_BLOCKS])])
    assert len(check._valid) <= NUM_BLOCKS


@pytest.mark.parametrize("seed", range(30))
def test_every_verdict_equals_a_check_that_keeps_nothing(seed):
    """Sequences whose tables grow, shrink, are replaced, or gain a bad block (out of the
    pool, or one they or another block already name); a refused step sent again."""
    rng = random.Random(seed)
    kept = checker()
    tables = {s: [rng.randrange(NUM_BLOCKS)] for s in range(6)}
    refused = 0
    for _ in range(300):
        for seq_id, table in tables.items():
            roll = rng.random()
            if roll < 0.3:
                table.append(rng.randrange(NUM_BLOCKS))
            elif roll < 0.35:
                table.append(rng.choice([-1, NUM_BLOCKS, *table]))
            elif roll < 0.4 and len(table) > 1:
                table.pop()
            elif roll < 0.45:
                tables[seq_id] = rng.sample(range(NUM_BLOCKS), rng.randint(1, 4))
            elif roll < 0.5:
                table[rng.randrange(len(table))] = rng.randrange(NUM_BLOCKS)
        pieces = [decode(s, t) for s, t in rng.sample(sorted(tables.items()), rng.randint(1, 6))]
        for _ in range(2 if rng.random() < 0.3 else 1):  # sometimes the same step again
            want = verdict(checker(), pieces)
            assert verdict(kept, pieces) == want, pieces
            refused += want != ""
        for seq_id, table in tables.items():  # a refused table is not sent on forever
            if len(set(table)) != len(table) or not all(0 <= b < NUM_BLOCKS for b in table):
                tables[seq_id] = [rng.randrange(NUM_BLOCKS)]
        if rng.random() < 0.05:
            kept.forget(rng.sample(sorted(tables), 2))
    assert refused > 10

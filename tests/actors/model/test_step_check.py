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


# The plain-rules test's model: 12 blocks of positions, so that a piece may pass its end
# with a table in the pool (at MAX_POSITION only a table longer than the pool reaches it).
SHORT_MAX_POSITION = 48


def reference(pieces: list[Piece]) -> str:
    """The rules as the module docstring states them, piece by piece, keeping nothing: the
    first piece that breaks one named, or ""."""
    if not pieces:
        return "a step needs at least one piece"
    written: set[tuple[int, int]] = set()
    for i, p in enumerate(pieces):
        end = p.start + len(p.token_ids)
        needed = -(-end // BLOCK_SIZE)
        if not p.token_ids:
            return f"piece {i} has no token_ids"
        if p.start < 0:
            return f"piece {i} has a negative start position {p.start}"
        if end > SHORT_MAX_POSITION:
            return f"piece {i} reaches position {end - 1}, past max_position {SHORT_MAX_POSITION}"
        if len(p.block_table) < needed:
            return (
                f"block table of piece {i} has {len(p.block_table)} blocks; positions "
                f"0..{end - 1} need {needed} at block_size {BLOCK_SIZE}"
            )
        if len(p.block_table) > NUM_BLOCKS:
            return (
                f"block table of piece {i} has {len(p.block_table)} blocks, more than the "
                f"pool's {NUM_BLOCKS}"
            )
        for b in p.block_table:
            if not 0 <= b < NUM_BLOCKS:
                return f"block id {b} of piece {i} is outside the KV tensor's {NUM_BLOCKS} blocks"
        if len(set(p.block_table)) != len(p.block_table):
            return f"block table of piece {i} names a block twice"
        for t in (min(p.token_ids), max(p.token_ids)):
            if not 0 <= t < VOCAB:
                return f"token id {t} of piece {i} is outside the vocabulary of {VOCAB}"
        for pos in range(p.start, end):
            slot = (p.block_table[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
            if slot in written:
                return f"piece {i} writes KV slot {slot} that another token writes"
            written.add(slot)
    return ""


def random_piece(rng: random.Random, seq_id: int, table: list[int]) -> Piece:
    """A prefill chunk or a decode on ``table``, now and then broken one way."""
    count = 1 if rng.random() < 0.6 else rng.randint(1, 6)
    end = rng.randint(max(1, (len(table) - 1) * BLOCK_SIZE + 1), len(table) * BLOCK_SIZE)
    tokens = [rng.randrange(VOCAB) for _ in range(count)]
    start = max(end - count, 0)
    roll = rng.random()
    if roll < 0.02:
        tokens = []
    elif roll < 0.04:
        tokens[rng.randrange(len(tokens))] = rng.choice([-1, VOCAB, VOCAB + 7])
    elif roll < 0.06:
        start = -rng.randint(1, 3)
    elif roll < 0.08:
        start = SHORT_MAX_POSITION - rng.randint(0, 2)
    elif roll < 0.10:
        start += BLOCK_SIZE  # past its table's last block
    elif roll < 0.11:
        table = table + [rng.randrange(NUM_BLOCKS) for _ in range(NUM_BLOCKS)]  # too long
    return piece(tokens, start, table, seq_id=seq_id)


@pytest.mark.parametrize("seed", range(30))
def test_every_verdict_equals_the_rules_stated_plainly(seed):
    """Steps of decodes and prefill chunks, tables that grow, shrink, are replaced or share
    blocks, and every rule broken now and then: a checker kept across all of them gives each
    step the verdict (and error) of the plain rules, whether its whole-step pass or its
    piece-by-piece check decided."""
    rng = random.Random(seed)
    kept = StepChecker(
        block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_position=SHORT_MAX_POSITION, vocab=VOCAB
    )
    tables = {s: rng.sample(range(NUM_BLOCKS), rng.randint(1, 3)) for s in range(8)}
    verdicts = []
    for _ in range(300):
        for seq_id, table in tables.items():
            roll = rng.random()
            if roll < 0.25:
                table.append(rng.randrange(NUM_BLOCKS))  # sometimes one it names already
            elif roll < 0.3 and len(table) > 1:
                table.pop()
            elif roll < 0.35:
                tables[seq_id] = rng.sample(range(NUM_BLOCKS), rng.randint(1, 4))
            elif roll < 0.38:
                table[rng.randrange(len(table))] = rng.choice([-1, NUM_BLOCKS])
        chosen = rng.sample(sorted(tables.items()), rng.randint(1, len(tables)))
        pieces = [random_piece(rng, s, t) for s, t in chosen]
        for _ in range(2 if rng.random() < 0.2 else 1):  # sometimes the same step again
            want = reference(pieces)
            assert verdict(kept, pieces) == want, pieces
            verdicts.append(want)
        for seq_id, table in tables.items():  # a refused table is not sent on forever
            if len(set(table)) != len(table) or not all(0 <= b < NUM_BLOCKS for b in table):
                tables[seq_id] = [rng.randrange(NUM_BLOCKS)]
        if rng.random() < 0.05:
            kept.forget(rng.sample(sorted(tables), 2))
    assert verdicts.count("") > 50  # steps that pass, most of them by the whole-step pass
    rules = ("no token_ids", "negative start", "past max_position", "need", "than the pool",
             "KV tensor", "names a block twice", "vocabulary", "writes KV slot")  # fmt: skip
    broken = {rule for rule in rules for v in verdicts if rule in v}
    assert len(broken) >= 8, broken  # and nearly every rule broken

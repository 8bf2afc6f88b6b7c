"""The host's check of a step before it runs: every piece touches only its own slots.

A step is refused (ValueError naming the piece) when a piece has no tokens, starts below 0
or reaches past the model's positions, has a block table too short for its positions,
longer than the pool, naming a block outside the pool or a block twice, or a token
outside the vocabulary; or when two tokens of the step would write one KV slot.

It runs before every step, in the time the device waits for the next one, so it costs the
builtins' time (``min``, ``max``, ``set``), never a Python loop over blocks. Most of that is
the tables: a sequence's table arrives whole with every step, thousands of blocks a step at
a large batch, and changes by one block every ``block_size`` decodes. So the checker keeps,
per sequence, the last table it found valid, and of a table that begins with it checks only
the blocks after it (in range, and none named twice across the whole table): a tuple
comparison in C instead of three passes over the table.

What is kept is a fact about a tuple of block ids, not about the sequence: a table that
begins with a tuple found valid is valid up to its end, whichever sequence sends it. So a
kept entry can never make a wrong table pass, and forgetting one (a sequence's ``closed``,
or all of them when there are more than the pool has blocks) only costs a full check.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ringfence.sched.ops import Piece


@dataclass(slots=True)
class _Valid:
    """A table found valid, and its blocks as a set (for a new block's twin)."""

    table: tuple[int, ...]
    blocks: set[int]


class StepChecker:
    """The check of :mod:`this module <ringfence.actors.model.step_check>` for one pool and
    model; keeps the tables it found valid. Not thread-safe: the Worker's thread owns it."""

    def __init__(self, *, block_size: int, num_blocks: int, max_position: int, vocab: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_position = max_position
        self.vocab = vocab
        self._valid: dict[int, _Valid] = {}  # seq_id -> its last table found valid

    def check(self, pieces: Sequence[Piece]) -> None:
        """Refuse a step that would touch anything outside its pieces' own slots (ValueError)."""
        if not pieces:
            raise ValueError("a step needs at least one piece")
        bs, num_blocks, max_position = self.block_size, self.num_blocks, self.max_position
        written: set[tuple[int, int]] = set()
        for i, piece in enumerate(pieces):
            tokens, table, start = piece.token_ids, piece.block_table, piece.start
            end = start + len(tokens)
            if not tokens:
                raise ValueError(f"piece {i} has no token_ids")
            if start < 0:
                raise ValueError(f"piece {i} has a negative start position {start}")
            if end > max_position:
                raise ValueError(
                    f"piece {i} reaches position {end - 1}, past max_position {max_position}"
                )
            needed = -(-end // bs)
            if len(table) < needed:
                raise ValueError(
                    f"block table of piece {i} has {len(table)} blocks; positions "
                    f"0..{end - 1} need {needed} at block_size {bs}"
                )
            if len(table) > num_blocks:
                raise ValueError(
                    f"block table of piece {i} has {len(table)} blocks, more than "
                    f"the pool's {num_blocks}"
                )
            self._check_table(i, piece.seq_id, table)
            lo, hi = min(tokens), max(tokens)
            if lo < 0 or hi >= self.vocab:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"token id {bad} of piece {i} is outside the vocabulary of {self.vocab}"
                )
            for pos in range(start, end):
                slot = (table[pos // bs], pos % bs)
                if slot in written:
                    raise ValueError(f"piece {i} writes KV slot {slot} that another token writes")
                written.add(slot)

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Drop the kept tables of ended sequences (unknown ids are ignored)."""
        for seq_id in seq_ids:
            self._valid.pop(seq_id, None)

    def _check_table(self, i: int, seq_id: int, table: tuple[int, ...]) -> None:
        """Piece ``i``'s table: its ids in the pool and none twice; only the blocks past the
        sequence's last valid table when it begins with that one (module docstring)."""
        valid = self._valid.get(seq_id)
        if valid is not None:
            known = len(valid.table)
            if len(table) >= known and table[:known] == valid.table:
                new = table[known:]
                if new:
                    self._check_ids(i, new)
                    if len(set(new)) != len(new) or not valid.blocks.isdisjoint(new):
                        raise ValueError(f"block table of piece {i} names a block twice")
                    valid.blocks.update(new)
                    valid.table = table
                return
        self._check_ids(i, table)
        blocks = set(table)
        if len(blocks) != len(table):
            raise ValueError(f"block table of piece {i} names a block twice")
        if len(self._valid) >= self.num_blocks and seq_id not in self._valid:
            self._valid.clear()  # more kept than blocks: ended ones never closed; costs a check
        self._valid[seq_id] = _Valid(table, blocks)

    def _check_ids(self, i: int, blocks: tuple[int, ...]) -> None:
        num_blocks = self.num_blocks
        if min(blocks) < 0 or max(blocks) >= num_blocks:
            block = next(b for b in blocks if not 0 <= b < num_blocks)
            raise ValueError(
                f"block id {block} of piece {i} is outside the KV tensor's {num_blocks} blocks"
            )

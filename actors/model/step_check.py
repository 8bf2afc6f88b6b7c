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

The rules are checked over the whole step at once first (each a list built in C, then
``min``, ``max`` or a ``set``: the starts, the ends, the tokens, every token's KV slot as one
number), and the tables against the kept ones. Only a step that fails there, or holds a
table that neither is a kept one nor grows one, is checked piece by piece, which names the
first piece that breaks a rule (the same error whichever way a step was checked).

What is kept is a fact about a tuple of block ids, not about the sequence: a table that
begins with a tuple found valid is valid up to its end, whichever sequence sends it. So a
kept entry can never make a wrong table pass, and forgetting one (a sequence's ``closed``,
or all of them when there are more than the pool has blocks) only costs a full check.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from operator import add, gt, mul

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
        if not self._passes(pieces):
            self._check_each(pieces)

    def _passes(self, pieces: Sequence[Piece]) -> bool:
        """Every rule over the whole step at once, in the builtins' time: True when each
        holds (the tables kept as :meth:`_check_table` keeps them). False on anything else,
        for :meth:`_check_each` to name the first piece that breaks one, in piece order (or
        to find that they hold after all: a table that is neither kept nor grows a kept one)."""
        bs = self.block_size
        starts = [p.start for p in pieces]
        counts = [len(p.token_ids) for p in pieces]
        tables = [p.block_table for p in pieces]
        if min(counts) == 0 or min(starts) < 0:
            return False
        ends = list(map(add, starts, counts))
        if max(ends) > self.max_position:
            return False
        # (A table longer than the pool names a block twice or one outside it: found below.)
        if any(map(gt, ends, map(mul, map(len, tables), repeat(bs)))):
            return False  # a table short of its piece's last position
        tokens = list(chain.from_iterable(p.token_ids for p in pieces))
        if min(tokens) < 0 or max(tokens) >= self.vocab:
            return False
        # Each token's KV slot as one number (its block's id * bs + its offset), all distinct.
        # An id outside the pool may make two numbers equal or not: its table fails below.
        if max(counts) == 1:  # a decode step: one token a piece
            slots = [t[s // bs] * bs + s % bs for t, s in zip(tables, starts, strict=True)]
        else:
            slots = [
                t[pos // bs] * bs + pos % bs
                for t, s, e in zip(tables, starts, ends, strict=True)
                for pos in range(s, e)
            ]
        if len(set(slots)) != len(slots):
            return False
        valid = self._valid
        for piece, table in zip(pieces, tables, strict=True):
            kept = valid.get(piece.seq_id)
            if kept is not None and table == kept.table:
                continue  # most of a decode step: a tuple comparison in C
            if kept is None:
                if not self._keep_new(piece.seq_id, table):
                    return False
            elif not self._keeps(kept, table):
                return False
        return True

    def _check_each(self, pieces: Sequence[Piece]) -> None:
        """The rules piece by piece: the first piece that breaks one is named (ValueError)."""
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
        if valid is not None and self._keeps(valid, table):
            return
        # Where the table grows the kept one, the kept blocks are valid: the first id this
        # names is one of the new blocks, as a check of the new blocks alone would name.
        self._check_ids(i, table)
        if len(set(table)) != len(table):
            raise ValueError(f"block table of piece {i} names a block twice")
        self._keep_new(seq_id, table)

    def _keeps(self, valid: _Valid, table: tuple[int, ...]) -> bool:
        """Whether ``table`` is the kept one, or begins with it and adds only blocks in the
        pool that neither it nor the kept one names (then it is kept instead)."""
        known = len(valid.table)
        if len(table) == known:
            return table == valid.table
        if len(table) < known or table[:known] != valid.table:
            return False
        new = table[known:]
        if min(new) < 0 or max(new) >= self.num_blocks or len(set(new)) != len(new):
            return False
        if not valid.blocks.isdisjoint(new):
            return False
        valid.blocks.update(new)
        valid.table = table
        return True

    def _keep_new(self, seq_id: int, table: tuple[int, ...]) -> bool:
        """Keep ``table`` for ``seq_id`` if its ids are in the pool and none twice."""
        if not table or min(table) < 0 or max(table) >= self.num_blocks:
            return False
        blocks = set(table)
        if len(blocks) != len(table):
            return False
        if len(self._valid) >= self.num_blocks and seq_id not in self._valid:
            self._valid.clear()  # more kept than blocks: ended ones never closed; costs a check
        self._valid[seq_id] = _Valid(table, blocks)
        return True

    def _check_ids(self, i: int, blocks: tuple[int, ...]) -> None:
        num_blocks = self.num_blocks
        if min(blocks) < 0 or max(blocks) >= num_blocks:
            block = next(b for b in blocks if not 0 <= b < num_blocks)
            raise ValueError(
                f"block id {block} of piece {i} is outside the KV tensor's {num_blocks} blocks"
            )

"""Paged execution: one mixed step of prefill chunks and decode tokens over a block-major KV tensor.

The KV tensor is laid out ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``
(DESIGN.md, "Blocks and tiers"): one block is one contiguous run of bytes holding every
layer's K (index 0) and V (index 1) for ``block_size`` consecutive positions. The token
at position ``pos`` of a sequence lives in slot ``pos % block_size`` of block
``block_table[pos // block_size]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ringfence.actors.model import Model, ModelConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """One sequence's share of a step: a prefill chunk (any length >= 1) or one decode token."""

    token_ids: Sequence[int]  # the tokens of this piece, at positions start..start+len-1
    start: int  # position of token_ids[0]; positions 0..start-1 are already in the KV blocks
    block_table: Sequence[int]  # block ids covering positions 0..start+len-1 (more are allowed)


class _StepIndex(NamedTuple):
    """Index tensors of one step, built once and used by every layer."""

    lengths: list[int]  # tokens per piece
    token_ids: Tensor  # [T] all pieces' tokens, in piece order
    positions: Tensor  # [T] position of each token in its sequence
    slot_blocks: Tensor  # [T] block each token's K/V is written to
    slot_offsets: Tensor  # [T] slot in that block
    tables: list[Tensor]  # per piece: the blocks covering positions 0..end-1
    masks: list[Tensor]  # per piece: [length, end] True where a query may attend


class StepOutput(NamedTuple):
    last_logits: Tensor  # [num_pieces, vocab]: logits of the last token of each piece
    all_logits: Tensor | None  # [total tokens, vocab] in piece order, when asked for


def make_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Tensor:
    """A new, uninitialized block-major KV tensor (its contents are garbage until written)."""
    shape = (num_blocks, config.layers, 2, block_size, config.kv_heads, config.head_dim)
    return torch.empty(shape, dtype=dtype, device=device)


class PagedExecutor:
    """Runs steps of ``model`` whose keys and values live in ``kv``, read through block tables.

    ``kv`` may be an existing tensor (e.g. in shared memory); it must have the model's dtype
    and the block-major shape. A step writes only the slots of its pieces' positions and
    reads only positions 0..start+len-1 of each piece's own blocks, so blocks outside the
    tables and unwritten slots may hold anything, NaN included. Pieces of one step must
    not write the same slot. Not thread-safe: one caller (the Worker) runs steps in order.
    """

    def __init__(self, model: Model, kv: Tensor) -> None:
        c = model.config
        if kv.dim() != 6 or (kv.shape[1], kv.shape[2], kv.shape[4], kv.shape[5]) != (
            c.layers,
            2,
            c.kv_heads,
            c.head_dim,
        ):
            raise ValueError(
                f"kv shape {tuple(kv.shape)} is not [num_blocks, {c.layers}, 2, block_size, "
                f"{c.kv_heads}, {c.head_dim}]"
            )
        if kv.dtype != model.dtype:
            raise ValueError(f"kv dtype {kv.dtype} differs from the model dtype {model.dtype}")
        self.model = model
        self.kv = kv
        self.num_blocks = kv.shape[0]
        self.block_size = kv.shape[3]

    def check(self, pieces: Sequence[Piece]) -> None:
        """Refuse a step that would touch anything outside its pieces' own slots (ValueError)."""
        if not pieces:
            raise ValueError("a step needs at least one piece")
        written: set[tuple[int, int]] = set()
        for i, piece in enumerate(pieces):
            end = piece.start + len(piece.token_ids)
            if not piece.token_ids:
                raise ValueError(f"piece {i} has no token_ids")
            if piece.start < 0:
                raise ValueError(f"piece {i} has a negative start position {piece.start}")
            if end > self.model.config.max_position:
                raise ValueError(
                    f"piece {i} reaches position {end - 1}, past max_position "
                    f"{self.model.config.max_position}"
                )
            needed = -(-end // self.block_size)
            if len(piece.block_table) < needed:
                raise ValueError(
                    f"block table of piece {i} has {len(piece.block_table)} blocks; positions "
                    f"0..{end - 1} need {needed} at block_size {self.block_size}"
                )
            if len(piece.block_table) > self.num_blocks:
                raise ValueError(
                    f"block table of piece {i} has {len(piece.block_table)} blocks, more than "
                    f"the pool's {self.num_blocks}"
                )
            for block in piece.block_table:
                if not 0 <= block < self.num_blocks:
                    raise ValueError(
                        f"block id {block} of piece {i} is outside the KV tensor's "
                        f"{self.num_blocks} blocks"
                    )
            if len(set(piece.block_table)) != len(piece.block_table):
                raise ValueError(f"block table of piece {i} names a block twice")
            vocab = self.model.config.vocab_size
            lo, hi = min(piece.token_ids), max(piece.token_ids)
            if lo < 0 or hi >= vocab:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"token id {bad} of piece {i} is outside the vocabulary of {vocab}"
                )
            for pos in range(piece.start, end):
                slot = (piece.block_table[pos // self.block_size], pos % self.block_size)
                if slot in written:
                    raise ValueError(f"piece {i} writes KV slot {slot} that another token writes")
                written.add(slot)

    def _index(self, pieces: Sequence[Piece]) -> _StepIndex:
        bs = self.block_size
        lengths = [len(p.token_ids) for p in pieces]
        spans = [range(p.start, p.start + n) for p, n in zip(pieces, lengths, strict=True)]
        positions = torch.tensor([pos for span in spans for pos in span], dtype=torch.long)
        blocks = [
            p.block_table[pos // bs] for p, span in zip(pieces, spans, strict=True) for pos in span
        ]
        return _StepIndex(
            lengths=lengths,
            token_ids=torch.tensor([t for p in pieces for t in p.token_ids], dtype=torch.long),
            positions=positions,
            slot_blocks=torch.tensor(blocks, dtype=torch.long),
            slot_offsets=positions % bs,
            tables=[
                torch.tensor(p.block_table[: -(-span.stop // bs)], dtype=torch.long)
                for p, span in zip(pieces, spans, strict=True)
            ],
            # Query at position pos sees keys 0..pos: [piece length, end] booleans.
            masks=[
                torch.arange(span.stop).unsqueeze(0) <= torch.tensor(span).unsqueeze(1)
                for span in spans
            ],
        )

    @torch.inference_mode()
    def step(self, pieces: Sequence[Piece], *, all_logits: bool = False) -> StepOutput:
        """Run one step: write each token's K/V into its slot, attend causally, return logits.

        Linear layers run once over all tokens of the step; attention loops per piece.
        Mutates ``kv`` (the slots of the pieces' positions only); reads nothing else of it
        beyond each piece's positions 0..start+len-1.
        """
        self.check(pieces)
        model, c, bs = self.model, self.model.config, self.block_size
        ix = self._index(pieces)
        # One gather buffer each for K and V per step, sized for the longest table:
        # index_select writes into them instead of allocating per sequence and layer.
        shape = (max(len(t) for t in ix.tables), bs, c.kv_heads, c.head_dim)
        k_buf = torch.empty(shape, dtype=self.kv.dtype, device=self.kv.device)
        v_buf = torch.empty(shape, dtype=self.kv.dtype, device=self.kv.device)
        x = model.embed(ix.token_ids)
        for layer in range(c.layers):
            q, k, v = model.attention_inputs(layer, x, ix.positions)
            # Write before reading: a piece's queries attend to its own new tokens too.
            self.kv[ix.slot_blocks, layer, 0, ix.slot_offsets] = k
            self.kv[ix.slot_blocks, layer, 1, ix.slot_offsets] = v
            outs = []
            for q_piece, table, mask in zip(
                torch.split(q, ix.lengths), ix.tables, ix.masks, strict=True
            ):
                end = mask.shape[1]
                keys, values = k_buf[: len(table)], v_buf[: len(table)]
                torch.index_select(self.kv[:, layer, 0], 0, table, out=keys)
                torch.index_select(self.kv[:, layer, 1], 0, table, out=values)
                # Slice to positions 0..end-1 before any arithmetic: the unwritten tail of
                # the last block may be NaN, and NaN * 0 is still NaN.
                keys = keys.view(-1, c.kv_heads, c.head_dim)[:end].transpose(0, 1)
                values = values.view(-1, c.kv_heads, c.head_dim)[:end].transpose(0, 1)
                out = F.scaled_dot_product_attention(
                    q_piece.transpose(0, 1), keys, values, attn_mask=mask, enable_gqa=True
                )
                outs.append(out.transpose(0, 1).reshape(mask.shape[0], -1))
            x = model.finish_layer(layer, x, torch.cat(outs))
        last = torch.tensor(ix.lengths).cumsum(0) - 1
        if all_logits:
            logits = model.logits(x)
            return StepOutput(logits[last], logits)
        return StepOutput(model.logits(x[last]), None)

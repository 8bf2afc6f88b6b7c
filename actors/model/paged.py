"""Paged execution: one mixed step of prefill chunks and decode tokens over a block-major KV tensor.

The KV tensor is laid out ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``
(DESIGN.md, "Blocks and tiers"): one block is one contiguous run of bytes holding every
layer's K (index 0) and V (index 1) for ``block_size`` consecutive positions. The token
at position ``pos`` of a sequence lives in slot ``pos % block_size`` of block
``block_table[pos // block_size]``.

Under a sliding window (``ModelShape.sliding_window``), a query at position i attends to
keys j with i - window < j <= i, in decode and prefill-chunk pieces alike, as transformers
masks them. Every block of a table is still kept, read and written as without a window:
blocks wholly older than the window are masked, not freed.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ringfence.actors.model.decoder import Model, ModelShape, window_mask
from ringfence.sched.ops import Piece


class _Decodes(NamedTuple):
    """The one-token pieces of a step, attended in one batched call per layer."""

    rows: Tensor  # [D] their rows in the step's token order
    table: Tensor  # [D * width] block ids, each piece's table padded to width blocks
    valid: Tensor  # [D, width * block_size] True at the positions the piece's query sees
    hidden: Tensor  # flat indices of positions end.. past each piece (zeroed after each gather)
    width: int


class _Chunk(NamedTuple):
    """A prefill chunk (two or more tokens), attended on its own."""

    first: int  # its first row in the step's token order
    length: int
    table: Tensor  # the blocks covering positions 0..end-1
    end: int  # start + length
    mask: Tensor | None  # [length, end] causal (and window) mask; None: plain causal from 0


class _StepIndex(NamedTuple):
    """Index tensors of one step, built once and used by every layer."""

    lengths: list[int]  # tokens per piece
    token_ids: Tensor  # [T] all pieces' tokens, in piece order
    positions: Tensor  # [T] position of each token in its sequence
    slot_blocks: Tensor  # [T] block each token's K/V is written to
    slot_offsets: Tensor  # [T] slot in that block
    last: Tensor  # [pieces] the row of each piece's last token
    decodes: _Decodes | None
    chunks: list[_Chunk]


class Touched(NamedTuple):
    """The device blocks one step indexed: gathered for attention, and scattered K/V into."""

    reads: list[int]
    writes: list[int]


class StepOutput(NamedTuple):
    last_logits: Tensor  # [num_pieces, vocab]: logits of the last token of each piece
    all_logits: Tensor | None  # [total tokens, vocab] in piece order, when asked for
    # piece index -> logits [its tokens, vocab] of every token of it, for the pieces asked
    piece_logits: dict[int, Tensor] | None = None


def make_kv_cache(
    config: ModelShape,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Tensor:
    """A new, uninitialized block-major KV tensor (its contents are garbage until written).
    ``config``: the shape whose KV heads it holds (a rank's: ``Model.local``)."""
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
        c = model.local  # this rank's heads (all of them on a single rank)
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
        # Set by the Worker when tracing: each step then keeps ``touched``, the blocks its
        # index tensors read and wrote (a copy to the host, so only at trace level).
        self.record_touches = False
        self.touched: Touched | None = None

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
        """The step's index tensors, made on the KV tensor's device."""
        bs, dev = self.block_size, self.kv.device
        window = self.model.config.sliding_window
        lengths = [len(p.token_ids) for p in pieces]
        spans = [range(p.start, p.start + n) for p, n in zip(pieces, lengths, strict=True)]
        flat = [pos for span in spans for pos in span]
        blocks = [
            p.block_table[pos // bs] for p, span in zip(pieces, spans, strict=True) for pos in span
        ]
        decodes, chunks, first = [], [], 0
        for p, span in zip(pieces, spans, strict=True):
            table = p.block_table[: -(-span.stop // bs)]
            if len(span) == 1:
                decodes.append((first, table, span.stop))
            else:
                mask = None
                # Query at position pos sees keys 0..pos (pos-window+1..pos under a window).
                if p.start or (window is not None and window < span.stop):
                    keys = torch.arange(span.stop, device=dev)
                    mask = window_mask(torch.tensor(span, device=dev), keys, window)
                index = torch.tensor(table, dtype=torch.long, device=dev)
                chunks.append(_Chunk(first, len(span), index, span.stop, mask))
            first += len(span)
        positions = torch.tensor(flat, dtype=torch.long, device=dev)
        return _StepIndex(
            lengths=lengths,
            token_ids=torch.tensor(
                [t for p in pieces for t in p.token_ids], dtype=torch.long, device=dev
            ),
            positions=positions,
            slot_blocks=torch.tensor(blocks, dtype=torch.long, device=dev),
            slot_offsets=positions % bs,
            last=torch.tensor(lengths, device=dev).cumsum(0) - 1,
            decodes=_decodes(decodes, bs, dev, window) if decodes else None,
            chunks=chunks,
        )

    @torch.inference_mode()
    def step(
        self, pieces: Sequence[Piece], *, all_logits: bool = False, whole: Collection[int] = ()
    ) -> StepOutput:
        """Run one step (see :meth:`hidden`) and return its logits: of each piece's last
        token, and of every token of the pieces whose indices are in ``whole`` (their
        prompt log probabilities; the LM head runs on those rows only)."""
        x, last = self.hidden(pieces)
        if all_logits:
            every = self.model.logits(x)
            return StepOutput(every[last], every)
        rows = None
        if whole:
            ends = last.tolist()
            rows = {}
            for i in whole:
                first = ends[i] - len(pieces[i].token_ids) + 1
                rows[i] = self.model.logits(x[first : ends[i] + 1])
        return StepOutput(self.model.logits(x[last]), None, rows)

    @torch.inference_mode()
    def step_without_logits(self, pieces: Sequence[Piece]) -> None:
        """Run one step and skip the LM head: what a tensor-parallel rank other than 0 does
        (it writes its KV heads and takes part in the all-reduces; rank 0 samples)."""
        self.hidden(pieces)

    def hidden(self, pieces: Sequence[Piece]) -> tuple[Tensor, Tensor]:
        """Run one step: write each token's K/V into its slot, attend causally; the final
        hidden states [T, hidden] and the row of each piece's last token.

        Linear layers run once over all tokens of the step. Attention runs once per layer
        for all one-token (decode) pieces together, over their tables gathered into one
        padded buffer, and once per layer for each longer (prefill) chunk. Mutates ``kv``
        (the slots of the pieces' positions only); reads nothing else of it beyond each
        piece's positions 0..start+len-1: every position past a piece's end is masked out
        and zeroed before any arithmetic, since a free block or an unwritten slot may hold
        NaN, and NaN * 0 is still NaN.
        """
        self.check(pieces)
        model, c = self.model, self.model.local
        ix = self._index(pieces)
        kv, dec = self.kv, ix.decodes
        if self.record_touches:
            self.touched = _touched(ix)
        if dec is not None:  # gather buffers, reused by every layer
            shape = (len(dec.table), self.block_size, c.kv_heads, c.head_dim)
            k_dec = torch.empty(shape, dtype=kv.dtype, device=kv.device)
            v_dec = torch.empty(shape, dtype=kv.dtype, device=kv.device)
            dec_mask = dec.valid.view(len(dec.rows), 1, 1, -1)
        x = model.embed(ix.token_ids)
        for layer in range(c.layers):
            q, k, v = model.attention_inputs(layer, x, ix.positions)
            # Write before reading: a piece's queries attend to its own new tokens too.
            kv[ix.slot_blocks, layer, 0, ix.slot_offsets] = k
            kv[ix.slot_blocks, layer, 1, ix.slot_offsets] = v
            out = torch.empty(q.shape[0], c.heads * c.head_dim, dtype=q.dtype, device=q.device)
            if dec is not None:
                n = len(dec.rows)
                torch.index_select(kv[:, layer, 0], 0, dec.table, out=k_dec)
                torch.index_select(kv[:, layer, 1], 0, dec.table, out=v_dec)
                if len(dec.hidden):  # only the tails past each end, not the whole buffer
                    k_dec.view(-1, c.kv_heads, c.head_dim).index_fill_(0, dec.hidden, 0)
                    v_dec.view(-1, c.kv_heads, c.head_dim).index_fill_(0, dec.hidden, 0)
                keys = k_dec.view(n, -1, c.kv_heads, c.head_dim)
                values = v_dec.view(n, -1, c.kv_heads, c.head_dim)
                attended = F.scaled_dot_product_attention(
                    q[dec.rows].unsqueeze(2),  # [n, heads, 1, dim]
                    keys.transpose(1, 2),
                    values.transpose(1, 2),
                    attn_mask=dec_mask,
                    enable_gqa=True,
                )
                out[dec.rows] = attended.view(n, -1)
            for chunk in ix.chunks:
                rows = slice(chunk.first, chunk.first + chunk.length)
                # Slice to positions 0..end-1: the unwritten tail of the last block may be NaN.
                keys = kv[chunk.table, layer, 0].view(-1, c.kv_heads, c.head_dim)[: chunk.end]
                values = kv[chunk.table, layer, 1].view(-1, c.kv_heads, c.head_dim)[: chunk.end]
                attended = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1).unsqueeze(0),  # [1, heads, length, dim]
                    keys.transpose(0, 1).unsqueeze(0),
                    values.transpose(0, 1).unsqueeze(0),
                    attn_mask=None
                    if chunk.mask is None
                    else chunk.mask.view(1, 1, *chunk.mask.shape),
                    is_causal=chunk.mask is None,
                    enable_gqa=True,
                )
                out[rows] = attended[0].transpose(0, 1).reshape(chunk.length, -1)
            x = model.finish_layer(layer, x, out)
        return x, ix.last


def _touched(ix: _StepIndex) -> Touched:
    """The blocks the index tensors of a step make it read (every table it gathers) and
    write (every block a K/V slot is scattered to)."""
    tables = [chunk.table for chunk in ix.chunks]
    if ix.decodes is not None:
        tables.append(ix.decodes.table)
    reads = sorted(set(torch.cat(tables).tolist())) if tables else []
    return Touched(reads, sorted(set(ix.slot_blocks.tolist())))


def _decodes(
    decodes: Sequence[tuple[int, Sequence[int], int]],
    block_size: int,
    device: torch.device,
    window: int | None,
) -> _Decodes:
    """Pad the decode pieces' tables to one width (with their own first block, masked)."""
    width = max(len(table) for _, table, _ in decodes)
    table = [b for _, t, _ in decodes for b in (*t, *(t[0],) * (width - len(t)))]
    ends = torch.tensor([end for _, _, end in decodes], device=device).unsqueeze(1)
    keys = torch.arange(width * block_size, device=device).unsqueeze(0)
    written = keys < ends
    # Older keys than the window are written (finite): masked, but need no zeroing.
    valid = written if window is None else written & (keys >= ends - window)
    return _Decodes(
        rows=torch.tensor([row for row, _, _ in decodes], dtype=torch.long, device=device),
        table=torch.tensor(table, dtype=torch.long, device=device),
        valid=valid,
        hidden=torch.nonzero(~written.flatten()).flatten(),
        width=width,
    )

"""The torch attention backend: each piece's blocks gathered into contiguous tensors, then SDPA.

The reference the Triton kernels are checked against, and the path of a plain install.
Decode (one-token) pieces are attended together, once per layer, over their tables gathered
into one padded buffer; each prefill chunk (two or more tokens) is attended on its own over
its blocks. Every gathered position past a piece's end is masked out and zeroed before any
arithmetic, since a free block or an unwritten slot may hold NaN, and NaN * 0 is still NaN.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ringfence.actors.model.decoder import Model, window_mask
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


class TorchAttention:
    """Makes a step's :class:`TorchStep` over ``kv`` (block-major, this rank's heads)."""

    def __init__(self, model: Model, kv: Tensor) -> None:
        self.shape = model.local
        self.window = model.config.sliding_window
        self.kv = kv
        self.block_size = kv.shape[3]

    def prepare(self, pieces: Sequence[Piece]) -> TorchStep:
        bs, dev, window = self.block_size, self.kv.device, self.window
        blocks: list[int] = []
        offsets: list[int] = []
        decodes: list[tuple[int, Sequence[int], int]] = []
        chunks: list[_Chunk] = []
        first = 0
        for p in pieces:
            span = range(p.start, p.start + len(p.token_ids))
            blocks.extend(p.block_table[pos // bs] for pos in span)
            offsets.extend(pos % bs for pos in span)
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
        return TorchStep(
            self,
            torch.tensor(blocks, dtype=torch.long, device=dev),
            torch.tensor(offsets, dtype=torch.long, device=dev),
            _decodes(decodes, bs, dev, window) if decodes else None,
            chunks,
        )


class TorchStep:
    """One step's slots, decode buffers and chunks; the gather buffers are reused by every
    layer. Mutates the KV tensor at the step's slots only."""

    def __init__(
        self,
        backend: TorchAttention,
        slot_blocks: Tensor,
        slot_offsets: Tensor,
        decodes: _Decodes | None,
        chunks: list[_Chunk],
    ) -> None:
        self.kv, self.shape = backend.kv, backend.shape
        self.slot_blocks, self.slot_offsets = slot_blocks, slot_offsets
        self.decodes, self.chunks = decodes, chunks
        if decodes is not None:
            c, kv = self.shape, self.kv
            shape = (len(decodes.table), backend.block_size, c.kv_heads, c.head_dim)
            self.k_dec = torch.empty(shape, dtype=kv.dtype, device=kv.device)
            self.v_dec = torch.empty(shape, dtype=kv.dtype, device=kv.device)
            self.dec_mask = decodes.valid.view(len(decodes.rows), 1, 1, -1)

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        self.kv[self.slot_blocks, layer, 0, self.slot_offsets] = k
        self.kv[self.slot_blocks, layer, 1, self.slot_offsets] = v

    def attend(self, layer: int, q: Tensor) -> Tensor:
        c, kv, dec = self.shape, self.kv, self.decodes
        out = torch.empty(q.shape[0], c.heads * c.head_dim, dtype=q.dtype, device=q.device)
        if dec is not None:
            n, k_dec, v_dec = len(dec.rows), self.k_dec, self.v_dec
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
                attn_mask=self.dec_mask,
                enable_gqa=True,
            )
            out[dec.rows] = attended.view(n, -1)
        for chunk in self.chunks:
            rows = slice(chunk.first, chunk.first + chunk.length)
            # Slice to positions 0..end-1: the unwritten tail of the last block may be NaN.
            keys = kv[chunk.table, layer, 0].view(-1, c.kv_heads, c.head_dim)[: chunk.end]
            values = kv[chunk.table, layer, 1].view(-1, c.kv_heads, c.head_dim)[: chunk.end]
            attended = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0),  # [1, heads, length, dim]
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=None if chunk.mask is None else chunk.mask.view(1, 1, *chunk.mask.shape),
                is_causal=chunk.mask is None,
                enable_gqa=True,
            )
            out[rows] = attended[0].transpose(0, 1).reshape(chunk.length, -1)
        return out


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

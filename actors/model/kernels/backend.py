"""The Triton attention backend: a step's index tensors for the kernels of ``paged_attention.py``.

Every index of a step is built on the host in one int32 buffer and crosses to the device in
one copy (a step's pieces are Python lists; per-tensor copies would cost a transfer each).
The buffer is an ``array('i')`` filled by its C ``extend`` (a table slice at a time, never a
block at a time in Python) and handed to torch without a copy: at 256 decodes of 33-block
tables this is a third of the time of a flattened list through ``torch.tensor``.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch
from torch import Tensor

from ringfence.actors.model.decoder import Model
from ringfence.actors.model.host import to_device
from ringfence.actors.model.kernels.kv_store import store_kv
from ringfence.actors.model.kernels.paged_attention import StepTensors, paged_attention, tile_rows
from ringfence.actors.model.kernels.split_keys import (
    MOST_SPLITS,
    SPLIT_KEYS,
    Partials,
    acc_dtype,
    decode_keys,
    split_count,
)
from ringfence.sched.ops import Piece


class TritonAttention:
    """Makes a step's :class:`TritonStep` over ``kv`` (block-major, this rank's heads); a
    decode-only step's keys are shared out among at most ``splits`` programs per piece and
    KV head where the device has room for them (``split_keys.py``; 1: never)."""

    def __init__(self, model: Model, kv: Tensor, *, splits: int = MOST_SPLITS) -> None:
        self.group = model.local.heads // model.local.kv_heads
        self.kv_heads = model.local.kv_heads
        self.window = model.config.sliding_window
        self.kv = kv
        self.block_size = kv.shape[3]
        self.splits = splits

    def prepare(self, pieces: Sequence[Piece]) -> TritonStep:
        tensors = step_tensors(pieces, self.block_size, self.group, self.kv.device)
        if all(len(p.token_ids) == 1 for p in pieces):  # a decode-only step
            keys = decode_keys((p.start for p in pieces), self.window)
            programs = len(pieces) * self.kv_heads
            splits = split_count(programs, keys, self.kv.device, self.splits)
            tensors = tensors._replace(splits=splits, split_keys=SPLIT_KEYS)
        return TritonStep(self.kv, tensors, self.window)


def step_tensors(
    pieces: Sequence[Piece], block_size: int, group: int, device: torch.device
) -> StepTensors:
    """The kernels' description of ``pieces`` (checked beforehand by ``PagedExecutor.check``),
    unsplit."""
    bs = block_size
    lengths = [len(p.token_ids) for p in pieces]
    ends = [p.start + n for p, n in zip(pieces, lengths, strict=True)]
    block_q, _ = tile_rows(group, max(lengths))
    width = max(-(-end // bs) for end in ends)
    slots: list[int] = []
    starts = [0]
    program_piece: list[int] = []
    program_first: list[int] = []
    for i, (p, n, end) in enumerate(zip(pieces, lengths, ends, strict=True)):
        slots.extend(p.block_table[pos // bs] * bs + pos % bs for pos in range(p.start, end))
        starts.append(starts[-1] + n)
        firsts = range(0, n, block_q)
        program_piece.extend([i] * len(firsts))
        program_first.extend(firsts)
    tables = table_rows(pieces, ends, bs, width)
    parts = (slots, tables, starts, ends, program_piece, program_first)
    buffer = array("i", slots)
    for part in parts[1:]:
        buffer.extend(part)
    host = torch.frombuffer(buffer, dtype=torch.int32)  # shares the array's memory
    flat = to_device(host, device)  # pinned, then queued: the host does not wait (host.py)
    views = torch.split(flat, [len(part) for part in parts])
    return StepTensors(
        slots=views[0],
        tables=views[1].view(len(pieces), width),
        query_start=views[2],
        seq_lens=views[3],
        program_piece=views[4],
        program_first=views[5],
        block_q=block_q,
    )


def table_rows(
    pieces: Sequence[Piece], ends: Sequence[int], block_size: int, width: int, rows: int = 0
) -> array[int]:
    """Each piece's block table up to its end (``ends``), padded with block 0 to ``width``
    columns, row-major, then zero rows up to ``rows``: the kernels' ``tables``, as int32."""
    out = array("i")
    for p, end in zip(pieces, ends, strict=True):
        used = -(-end // block_size)
        out.extend(p.block_table[:used])
        out.frombytes(bytes(4 * (width - used)))
    out.frombytes(bytes(4 * width * max(0, rows - len(pieces))))
    return out


class TritonStep:
    """One step's index tensors, used by every layer; mutates the KV at the step's slots only.

    Also what a captured CUDA graph runs, over its static buffers (``actors/model/graphs.py``).
    """

    def __init__(self, kv: Tensor, tensors: StepTensors, window: int | None) -> None:
        self.kv, self.tensors, self.window = kv, tensors, window
        self.partials: Partials | None = None  # a split step's shares, made by its first layer

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        store_kv(k, v, self.kv[:, layer, 0], self.kv[:, layer, 1], self.tensors.slots)

    def attend(self, layer: int, q: Tensor) -> Tensor:
        out = torch.empty_like(q)
        kv, tensors = self.kv, self.tensors
        if tensors.splits > 1 and self.partials is None:
            self.partials = Partials.empty(q, tensors.splits, acc_dtype(kv.dtype))
        k, v = kv[:, layer, 0], kv[:, layer, 1]
        paged_attention(q, k, v, out, tensors, window=self.window, partials=self.partials)
        return out.view(q.shape[0], -1)

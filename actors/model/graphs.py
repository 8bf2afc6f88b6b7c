"""Decode steps captured as CUDA graphs per batch-size bucket, and replayed.

A decode step of a small model launches a few hundred small kernels (16 layers of norms,
projections, rotary, attention, MLP), and on a GPU their launch costs more than their work.
A CUDA graph replays the whole forward as one launch. As nano-vllm and vLLM do it: a
decode-only step (every piece one token) is padded up to the next bucket (1, 2, 4, ..., 256,
and ``max_batch``), its inputs are copied into static buffers that the bucket's graph reads,
and the graph is replayed; the real rows' logits are returned. Each bucket is captured on
first use, after a warm-up run on a side stream (Triton compiles its kernels and cuBLAS
makes its workspace on first use, which capture refuses), into one memory pool shared by
the buckets. The Worker captures every bucket when it starts (:meth:`DecodeGraphs.capture_all`,
largest first, on padding rows alone), so that no step of a run waits for a capture: the
first use of a bucket cost a decode step tens of milliseconds, and a run whose batch shrinks
meets every bucket below its largest. Prefill and mixed steps run eagerly.

A bucket has two graphs where its batch leaves the GPU's multiprocessors idle: one reads
each context's keys whole, one splits them among programs (``kernels/split_keys.py``), as
split as the widest table would be. A step replays the split one when its longest context
is longer than one share (256 keys): a short context reads fastest whole, with no merge.

Padding rows write nothing and read nothing: their slot is -1 (the store kernel skips it)
and their context length 0 (the attention kernel visits no key); they run through the
linear layers on token 0 at position 0, and their logits are dropped.

Only the Triton backend can be captured: its index tensors have fixed shapes per bucket and
it never synchronizes with the host. Block tables are padded to the widest table the pool
allows (``max_position`` positions, or every block), so any decode step fits its bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ringfence.actors.model.attention import run_layers
from ringfence.actors.model.decoder import Model
from ringfence.actors.model.host import copy_in, to_device
from ringfence.actors.model.kernels.backend import TritonStep, table_rows
from ringfence.actors.model.kernels.paged_attention import StepTensors, tile_rows
from ringfence.actors.model.kernels.split_keys import (
    MOST_SPLITS,
    SPLIT_KEYS,
    decode_keys,
    split_count,
)
from ringfence.sched.ops import Piece

if TYPE_CHECKING:
    from ringfence.actors.model.inputs import DeviceInputs

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    logits: Tensor  # [bucket, vocab]: the graph's output, overwritten by each replay


class Variant(NamedTuple):
    """Which graph a step replays: its bucket, and the programs each piece's keys are split
    among (1: read whole; ``split_keys.py``)."""

    bucket: int
    splits: int


class DecodeGraphs:
    """The graphs of one executor's decode steps, over its KV tensor (on CUDA, one rank;
    :meth:`run_eager` runs anywhere).

    Owned by the ``PagedExecutor``, used from its one thread. Replays mutate the KV tensor at
    the step's slots only, and the static buffers below.
    """

    def __init__(
        self, model: Model, kv: Tensor, *, max_batch: int, splits: int = MOST_SPLITS
    ) -> None:
        self.model, self.kv = model, kv
        self.most_splits = splits  # a bucket's keys shared out among at most this many programs
        self.block_size = bs = kv.shape[3]
        self.buckets = (*(b for b in BUCKETS if b < max_batch), max_batch)
        n, dev = self.buckets[-1], kv.device
        self.width = min(kv.shape[0], -(-model.config.max_position // bs))
        self.block_q, _ = tile_rows(model.local.heads // model.local.kv_heads, 1)
        # The static buffers every bucket's graph reads its first columns or rows of. A step's
        # inputs cross in two copies: the four per-piece rows of ``inputs``, and the tables.
        # All int32, as the eager kernels take them (the same compiled kernels serve both).
        self.inputs = torch.zeros(4, n, dtype=torch.int32, device=dev)
        self.token_ids, self.positions, self.slots, self.seq_lens = self.inputs
        self.tables = torch.zeros(n, self.width, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.program_piece = torch.arange(n, dtype=torch.int32, device=dev)
        self.program_first = torch.zeros(n, dtype=torch.int32, device=dev)
        self.pool: torch.cuda._POOL_HANDLE | None = None  # made at the first capture
        self.captured: dict[Variant, _Captured] = {}

    def fits(self, pieces: Sequence[Piece]) -> bool:
        """Whether a step is decode-only and within the largest bucket."""
        return len(pieces) <= self.buckets[-1] and all(len(p.token_ids) == 1 for p in pieces)

    def logits(self, pieces: Sequence[Piece], inputs: DeviceInputs | None = None) -> Tensor:
        """The logits [len(pieces), vocab] of a step that :meth:`fits` (checked beforehand by
        ``PagedExecutor.check``): its inputs copied in (``inputs``: the tokens of those pieces
        that are on the device), its bucket's graph replayed (CUDA)."""
        n = len(pieces)
        variant = self.variant(pieces)
        self._fill(pieces, variant.bucket, inputs)
        captured = self.captured.get(variant) or self._capture(variant)
        captured.graph.replay()
        return captured.logits[:n].clone()  # the next replay overwrites the graph's buffer

    def run_eager(self, pieces: Sequence[Piece], inputs: DeviceInputs | None = None) -> Tensor:
        """What a replay of the step computes, run eagerly on any device: the same padded
        buffers, the same forward (how the padding is checked without a GPU)."""
        n = len(pieces)
        variant = self.variant(pieces)
        self._fill(pieces, variant.bucket, inputs)
        return self._forward(variant)[:n]

    def variant(self, pieces: Sequence[Piece]) -> Variant:
        """The graph of a step that :meth:`fits`: its bucket, its keys split where its longest
        context is longer than one share (else read whole, as a short context reads fastest:
        no merge)."""
        bucket = next(b for b in self.buckets if b >= len(pieces))
        keys = decode_keys((p.start for p in pieces), self.model.config.sliding_window)
        return Variant(bucket, self.splits_of(bucket) if keys > SPLIT_KEYS else 1)

    def splits_of(self, bucket: int) -> int:
        """The split of ``bucket``'s graph for long contexts, as the widest table would be
        split: the kernel shares a shorter context out among fewer programs, so one capture
        serves every length (split_keys.py)."""
        programs = bucket * self.model.local.kv_heads
        longest = self.width * self.block_size
        return split_count(programs, longest, self.kv.device, self.most_splits)

    def variants(self) -> list[Variant]:
        """Every graph a step may replay, largest bucket first: each bucket read whole, and
        split where its split is more than 1."""
        out = []
        for bucket in sorted(self.buckets, reverse=True):
            out += [Variant(bucket, s) for s in sorted({1, self.splits_of(bucket)})]
        return out

    @torch.inference_mode()  # as a step's own capture ran: inside PagedExecutor.step
    def capture_all(self) -> list[Variant]:
        """Capture every variant not captured yet, largest bucket first (the pool is sized by
        the first), on inputs of padding rows alone, which write and read no KV; the
        variants captured. CUDA only."""
        done = []
        for variant in self.variants():
            if variant not in self.captured:
                self._pad(variant.bucket)
                self._capture(variant)
                done.append(variant)
        return done

    @torch.inference_mode()
    def run_padding(self, variant: Variant) -> Tensor:
        """What a capture at start runs, eagerly on any device: a bucket of padding rows (how
        it is checked without a GPU that they touch no KV)."""
        self._pad(variant.bucket)
        return self._forward(variant)

    def _pad(self, bucket: int) -> None:
        """Every row of ``bucket`` a padding row (see the module docstring)."""
        self.inputs[:, :bucket] = 0
        self.slots[:bucket] = -1
        self.tables[:bucket] = 0

    def _fill(self, pieces: Sequence[Piece], bucket: int, inputs: DeviceInputs | None) -> None:
        bs, pad = self.block_size, bucket - len(pieces)
        ends = [p.start + 1 for p in pieces]
        width = max(-(-end // bs) for end in ends)
        tables = table_rows(pieces, ends, bs, width, rows=bucket)
        # Padding rows: token 0 at position 0, slot -1 (no write), no context (no read).
        rows = [
            [p.token_ids[0] for p in pieces] + [0] * pad,
            [p.start for p in pieces] + [0] * pad,
            [p.block_table[p.start // bs] * bs + p.start % bs for p in pieces] + [-1] * pad,
            ends + [0] * pad,
        ]
        # Queued behind the step before's replay, which reads these buffers: never waited for.
        copy_in(self.inputs[:, :bucket], torch.tensor(rows, dtype=torch.int32))
        # Only the columns this step reads: the kernel reads no entry past a context's end.
        host = torch.frombuffer(tables, dtype=torch.int32)
        copy_in(self.tables[:bucket, :width], host.view(bucket, width))
        if inputs is not None:  # a row is its piece: their tokens put in on the device
            index = to_device(torch.tensor(inputs.pieces, dtype=torch.long), self.kv.device)
            self.token_ids.index_copy_(0, index, inputs.ids.to(torch.int32))

    def _forward(self, variant: Variant) -> Tensor:
        """The variant's forward over the static buffers: logits [bucket, vocab]."""
        bucket = variant.bucket
        tensors = StepTensors(
            slots=self.slots[:bucket],
            tables=self.tables[:bucket],
            query_start=self.query_start[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            program_piece=self.program_piece[:bucket],
            program_first=self.program_first[:bucket],
            block_q=self.block_q,
            splits=variant.splits,
            split_keys=SPLIT_KEYS,
        )
        step = TritonStep(self.kv, tensors, self.model.config.sliding_window)
        # Not model.embed: it checks the ids on the host, a sync that capture refuses
        # (PagedExecutor.check has refused any id outside the vocabulary already).
        x = F.embedding(self.token_ids[:bucket], self.model.model.embed_tokens.weight)
        return self.model.logits(run_layers(self.model, x, self.positions[:bucket], step))

    def _capture(self, variant: Variant) -> _Captured:
        device = self.kv.device
        # The warm-up runs the current step (its inputs are in the buffers): it writes the
        # very K/V the replay then writes again.
        side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._forward(variant)
        torch.cuda.current_stream(device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: CUDA calls of the process's other threads (a lane hosted beside the
        # Worker, a sampler's helper) must not invalidate this capture, nor it theirs.
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            logits = self._forward(variant)
        self.captured[variant] = _Captured(graph, logits)
        return self.captured[variant]

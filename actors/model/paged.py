"""Paged execution: one mixed step of prefill chunks and decode tokens over a block-major KV tensor.

The KV tensor is laid out ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``
(docs/design.md, "Blocks and tiers"): one block is one contiguous run of bytes holding every
layer's K (index 0) and V (index 1) for ``block_size`` consecutive positions. The token
at position ``pos`` of a sequence lives in slot ``pos % block_size`` of block
``block_table[pos // block_size]``.

Under a sliding window (``ModelShape.sliding_window``), a query at position i attends to
keys j with i - window < j <= i, in decode and prefill-chunk pieces alike, as transformers
masks them. Every block of a table is still kept, read and written as without a window:
blocks wholly older than the window are masked, not freed.

Where attention reads the blocks is the backend's business (``actors/model/attention.py``:
``torch`` gathers them, ``triton`` reads them in place); on CUDA with the Triton backend,
decode-only steps replay CUDA graphs (``actors/model/graphs.py``). Every layer's other work
is the model's own code (``Model.attention_inputs``, ``Model.finish_layer``), the same on
every path.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Iterable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from ringfence.actors.model.attention import BACKENDS, resolve_attention, run_layers
from ringfence.actors.model.config import Attention
from ringfence.actors.model.decoder import Model, ModelShape
from ringfence.actors.model.host import to_device
from ringfence.actors.model.inputs import DeviceInputs
from ringfence.actors.model.step_check import StepChecker
from ringfence.sched.ops import Piece

if TYPE_CHECKING:
    from ringfence.actors.model.graphs import DecodeGraphs


class _StepIndex(NamedTuple):
    """What every backend's step shares: the tokens, their positions, each piece's last row."""

    token_ids: Tensor  # [T] all pieces' tokens, in piece order
    positions: Tensor  # [T] position of each token in its sequence
    last: Tensor  # [pieces] the row of each piece's last token


class Touched(NamedTuple):
    """The device blocks one step indexed: gathered for attention, and scattered K/V into
    (sets: the Worker adds them to its op's record, which sorts them once, to log them)."""

    reads: set[int]
    writes: set[int]


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

    ``attention`` picks the backend (``resolve_attention``: ``auto``, ``torch``, ``triton``).
    ``cuda_graphs`` replays decode-only steps of up to ``max_batch`` pieces as CUDA graphs
    (:class:`DecodeGraphs`); it applies only on CUDA, with the Triton backend, on a single
    rank, and is ignored elsewhere. ``attention_splits`` is the most programs the Triton
    backend shares a decode's keys among, per piece and KV head (``kernels/split_keys.py``;
    1: never split).
    """

    def __init__(
        self,
        model: Model,
        kv: Tensor,
        *,
        attention: Attention = "torch",
        cuda_graphs: bool = False,
        max_batch: int = 256,
        attention_splits: int = 16,
    ) -> None:
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
        shape = model.config
        self.checker = StepChecker(
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_position=shape.max_position,
            vocab=shape.vocab_size,
        )
        self.backend_name = resolve_attention(attention, kv)
        self.backend = BACKENDS[self.backend_name](model, kv, attention_splits)
        # The fused kernels and stacked projections where the step runs Triton on a GPU (a
        # layer's 17 kernels become 10); the model's torch ops elsewhere, so the CPU's
        # numbers stay the reference's (the executor made last for a model decides).
        model.use_kernels(None)
        if self.backend_name == "triton" and kv.device.type == "cuda" and kv.dtype != torch.float64:
            from ringfence.actors.model.kernels import fused  # imports Triton

            model.use_kernels(fused())
        self.graphs: DecodeGraphs | None = None
        graphable = kv.device.type == "cuda" and model.shard.size == 1
        if cuda_graphs and graphable and self.backend_name == "triton":
            from ringfence.actors.model.graphs import DecodeGraphs  # imports Triton

            self.graphs = DecodeGraphs(model, kv, max_batch=max_batch, splits=attention_splits)
        # Set by the Worker when tracing: each step then keeps ``touched``, the blocks its
        # pieces read and wrote (worked out on the host from the tables, only when asked).
        self.record_touches = False
        self.touched: Touched | None = None

    def check(self, pieces: Sequence[Piece]) -> None:
        """Refuse a step that would touch anything outside its pieces' own slots (ValueError;
        ``actors/model/step_check.py``, which keeps the tables it found valid)."""
        self.checker.check(pieces)

    def forget(self, seq_ids: Iterable[int]) -> None:
        """The sequences ended: their kept tables are dropped (:class:`StepChecker`)."""
        self.checker.forget(seq_ids)

    def _index(self, pieces: Sequence[Piece], inputs: DeviceInputs | None) -> _StepIndex:
        """The step's shared index tensors, made on the KV tensor's device in one copy that
        does not wait for the device (``host.py``), the ``inputs`` on the device put in."""
        lengths = [len(p.token_ids) for p in pieces]
        tokens = [t for p in pieces for t in p.token_ids]
        flat = [
            pos for p, n in zip(pieces, lengths, strict=True) for pos in range(p.start, p.start + n)
        ]
        rows: list[int] = []  # the row of each piece's one token that is on the device
        if inputs is not None:
            ends = list(itertools.accumulate(lengths))
            rows = [ends[i] - 1 for i in inputs.pieces]
        host = torch.tensor(tokens + flat + lengths + rows, dtype=torch.long)
        on = to_device(host, self.kv.device)
        count, num = len(tokens), len(pieces)
        token_ids = on[:count]
        if inputs is not None:
            token_ids.index_copy_(0, on[2 * count + num :], inputs.ids)
        return _StepIndex(
            token_ids=token_ids,
            positions=on[count : 2 * count],
            last=on[2 * count : 2 * count + num].cumsum(0) - 1,
        )

    @torch.inference_mode()
    def step(
        self,
        pieces: Sequence[Piece],
        *,
        all_logits: bool = False,
        whole: Collection[int] = (),
        checked: bool = False,
        inputs: DeviceInputs | None = None,
    ) -> StepOutput:
        """Run one step (see :meth:`hidden`) and return its logits: of each piece's last
        token, and of every token of the pieces whose indices are in ``whole`` (their
        prompt log probabilities; the LM head runs on those rows only). A decode-only step
        that asks for no more than the last logits replays a CUDA graph where there are
        graphs (:class:`DecodeGraphs`). ``checked``: the caller ran :meth:`check` on these
        pieces already (the Worker does, to refuse a plan before it touches anything).
        ``inputs``: the one token of some pieces, still on the device (:class:`DeviceInputs`;
        the pieces' own ``token_ids`` are then placeholders, checked as any token)."""
        if self.graphs is not None and not all_logits and not whole and self.graphs.fits(pieces):
            if not checked:
                self.check(pieces)
            if self.record_touches:
                self.touched = _touched(pieces, self.block_size)
            return StepOutput(self.graphs.logits(pieces, inputs), None)
        x, last = self.hidden(pieces, checked=checked, inputs=inputs)
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
    def step_without_logits(self, pieces: Sequence[Piece], *, checked: bool = False) -> None:
        """Run one step and skip the LM head: what a tensor-parallel rank other than 0 does
        (it writes its KV heads and takes part in the all-reduces; rank 0 samples)."""
        self.hidden(pieces, checked=checked)

    def hidden(
        self,
        pieces: Sequence[Piece],
        *,
        checked: bool = False,
        inputs: DeviceInputs | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Run one step: write each token's K/V into its slot, attend causally; the final
        hidden states [T, hidden] and the row of each piece's last token.

        Linear layers run once over all tokens of the step; attention runs as the backend
        does it. Mutates ``kv`` (the slots of the pieces' positions only); reads nothing
        else of it beyond each piece's positions 0..start+len-1 (:meth:`check`, unless the
        caller says it ran it).
        """
        if not checked:
            self.check(pieces)
        ix = self._index(pieces, inputs)
        if self.record_touches:
            self.touched = _touched(pieces, self.block_size)
        attention = self.backend.prepare(pieces)
        x = self.model.embed(ix.token_ids, checked=True)  # check() refused any id outside it
        return run_layers(self.model, x, ix.positions, attention), ix.last


def _touched(pieces: Sequence[Piece], block_size: int) -> Touched:
    """The blocks a step reads (each piece's table up to its last position) and writes (the
    blocks of its new tokens' slots)."""
    reads: set[int] = set()
    writes: set[int] = set()
    for p in pieces:
        end = p.start + len(p.token_ids)
        reads.update(p.block_table[: -(-end // block_size)])
        writes.update(p.block_table[pos // block_size] for pos in range(p.start, end))
    return Touched(reads, writes)

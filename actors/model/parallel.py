"""Tensor parallelism: which slice of each tensor a rank holds, and the group that joins them.

Megatron-style (docs/design.md, "Ranks (tensor parallelism)"): q/k/v and gate/up are
column-parallel (each rank holds a contiguous run of the output rows: its heads, its
share of the SwiGLU inner width), o and down are row-parallel (each rank holds the
matching input columns) and are followed by an all-reduce that sums the ranks' partial
outputs. With contiguous runs of heads, rank r's query heads use exactly rank r's KV
heads under grouped-query attention, so attention needs no communication, and each
rank's KV tensor holds its ``kv_heads / tp_size`` heads of every block.

The embedding, the norms and the LM head are replicated: the embedding is a lookup (no
collective needed to produce the full hidden state every rank starts from), and only
rank 0 computes logits and samples (``PagedExecutor.step_without_logits`` on the others),
so the LM head costs no collective and the other ranks skip its matmul. The price is the
embedding's memory on every rank, which a vocabulary-parallel embedding would split.

Biases of column-parallel projections are sliced with their rows; a row-parallel
projection's bias (``o_proj.bias``) is added once, after the all-reduce.

The collective is torch.distributed: gloo on the CPU, NCCL on CUDA (:func:`join_group`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from ringfence.actors.model.shape import ModelShape

if TYPE_CHECKING:  # torch is imported by what runs a model, not by what checks a config
    import torch

# Projection name -> the dimension its weight (and bias, if it has the dimension) is split on.
_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows
_ROW = ("o_proj", "down_proj")  # input columns


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank's place in a tensor-parallel group of ``size`` ranks."""

    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"parallel.tp_size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside 0..{self.size - 1}")


def check_divisible(shape: ModelShape, size: int) -> None:
    """ValueError naming ``parallel.tp_size`` and the model's count it does not divide."""
    for count, what in (
        (shape.kv_heads, "KV heads"),
        (shape.heads, "attention heads"),
        (shape.intermediate, "MLP inner width (intermediate_size)"),
    ):
        if count % size:
            raise ValueError(f"parallel.tp_size ({size}) must divide the model's {count} {what}")


def local_shape(shape: ModelShape, size: int) -> ModelShape:
    """The widths one rank of ``size`` holds: its heads, KV heads and MLP inner width."""
    check_divisible(shape, size)
    return dataclasses.replace(
        shape,
        heads=shape.heads // size,
        kv_heads=shape.kv_heads // size,
        intermediate=shape.intermediate // size,
    )


def split_dim(name: str, ndim: int) -> int | None:
    """The dimension of state-dict tensor ``name`` (of ``ndim`` dimensions) that is split
    across ranks, or None when every rank holds all of it."""
    parts = name.split(".")
    if len(parts) < 2 or parts[-2] not in _COLUMN + _ROW:
        return None
    if parts[-2] in _COLUMN:
        return 0  # weight rows, and the bias along them
    return 1 if parts[-1] == "weight" and ndim == 2 else None  # a row-parallel bias: whole


def shard_range(name: str, full: tuple[int, ...], shard: Shard) -> tuple[int, int, int] | None:
    """(dim, start, length) of ``shard``'s slice of tensor ``name`` of shape ``full``; None
    when the tensor is replicated."""
    dim = split_dim(name, len(full))
    if dim is None or shard.size == 1:
        return None
    if full[dim] % shard.size:
        raise ValueError(
            f"tensor {name!r}: dimension {dim} of {list(full)} does not split into "
            f"parallel.tp_size = {shard.size} parts"
        )
    length = full[dim] // shard.size
    return dim, shard.rank * length, length


def take_shard(name: str, tensor: torch.Tensor, shard: Shard) -> torch.Tensor:
    """``shard``'s slice of the whole tensor ``name`` (a view; the tensor itself if whole)."""
    where = shard_range(name, tuple(tensor.shape), shard)
    return tensor if where is None else tensor.narrow(*where)


class Group:
    """The process group of one instance's Worker ranks, and the all-reduce the model calls.

    ``reduce_ns`` counts the nanoseconds spent in all-reduces since it was last read
    (:meth:`take_reduce_ns`): the Worker logs it per step, ``ringfence bench tp`` sums it.
    """

    def __init__(self, shard: Shard, process_group: object | None) -> None:
        self.shard = shard
        self.process_group = process_group
        self.reduce_ns = 0
        self.reduces = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of ``x`` (in place); ``x`` itself on a single rank."""
        if self.shard.size == 1:
            return x
        import torch.distributed as dist

        began = time.perf_counter_ns()
        dist.all_reduce(x, group=self.process_group)
        self.reduce_ns += time.perf_counter_ns() - began
        self.reduces += 1
        return x

    def take_reduce_ns(self) -> tuple[int, int]:
        """(nanoseconds, count) of the all-reduces since the last call; both reset."""
        taken = (self.reduce_ns, self.reduces)
        self.reduce_ns = self.reduces = 0
        return taken

    def close(self) -> None:
        if self.process_group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.process_group = None


WHOLE = Shard()  # a single rank: the whole model
SINGLE = Group(WHOLE, None)


def rendezvous_file(run_dir: str | os.PathLike[str], generation: int) -> Path:
    """Where the Worker ranks of one generation (their common incarnation) meet: a fresh
    file per generation, so that a restarted group never reads a dead group's keys."""
    return Path(run_dir) / f"worker-group.{generation}.store"


def join_group(
    shard: Shard, device: str, store_path: str | os.PathLike[str], timeout_s: float
) -> Group:
    """Join the group of ``shard.size`` ranks meeting at ``store_path`` (a torch FileStore):
    gloo when ``device`` is the CPU, NCCL on CUDA. ``timeout_s`` bounds the rendezvous and
    every collective (a rank whose peer died raises instead of waiting forever).
    """
    if shard.size == 1:
        return Group(shard, None)
    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    store = dist.FileStore(os.fspath(store_path), shard.size)  # type: ignore[attr-defined]
    kwargs: dict[str, object] = {}
    if backend == "nccl":
        import torch

        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(
        backend,
        store=store,
        rank=shard.rank,
        world_size=shard.size,
        timeout=timedelta(seconds=timeout_s),
        **kwargs,  # type: ignore[arg-type]
    )
    return Group(shard, dist.group.WORLD)


def rank_device(device: str, rank: int) -> str:
    """The device of ``rank``: the CPU for every rank, else CUDA device index + rank."""
    if not device.startswith("cuda"):
        return device
    _, _, index = device.partition(":")
    return f"cuda:{int(index or 0) + rank}"

"""Tensor-parallel ranks in spawned children: each joins a gloo group, builds its shard and
runs the same paged steps; rank 0 saves what it computed (module-level, so picklable)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peers import SPAWN, finish

BLOCK_SIZE = 4


def steps_of(prompt: list[int], following: list[int]) -> list[list[tuple[list[int], int]]]:
    """The steps of one sequence: its prompt in two chunks, then one token per step."""
    half = len(prompt) // 2
    steps = [[(prompt[:half], 0)], [(prompt[half:], half)]]
    position = len(prompt)
    for token in following:
        steps.append([([token], position)])
        position += 1
    return steps


def run_rank(
    rank: int,
    size: int,
    store: str,
    source: str,
    steps: list[list[tuple[list[int], int]]],
    out: str,
    poison: bool,
    device: str = "cpu",
) -> None:
    """Rank ``rank`` of ``size``: the model of ``source`` (a preset name, a checkpoint
    directory or a GGUF file) in float64, every step run over a paged KV tensor; rank 0
    saves each step's last logits to ``out`` (torch.save)."""
    import torch

    from ringfence.actors.model.checkpoint import load_checkpoint
    from ringfence.actors.model.decoder import Model
    from ringfence.actors.model.paged import PagedExecutor, make_kv_cache
    from ringfence.actors.model.parallel import Shard, join_group, rank_device
    from ringfence.sched.ops import Piece

    torch.set_num_threads(1)
    shard = Shard(rank, size)
    device = rank_device(device, rank)
    group = join_group(shard, device, store, timeout_s=60)
    try:
        if Path(source).is_dir() or source.endswith(".gguf"):
            model = load_checkpoint(source, dtype=torch.float64, shard=shard, group=group)
        else:
            model = Model.from_preset(source, torch.float64, 0, shard=shard, group=group)
        model = model.to(device)
        kv = make_kv_cache(model.local, 16, BLOCK_SIZE, torch.float64, device=device)
        kv.fill_(float("nan") if poison else 0.0)
        executor = PagedExecutor(model, kv)
        table = list(range(15, -1, -1))  # blocks out of order, all of one sequence
        saved = []
        for step in steps:
            pieces = [
                Piece(
                    seq_id=0,
                    start=start,
                    token_ids=tuple(ids),
                    block_table=tuple(table),
                    sample=True,
                )
                for ids, start in step
            ]
            if rank == 0:
                saved.append(executor.step(pieces).last_logits.to("cpu"))
            else:
                executor.step_without_logits(pieces)
        if rank == 0:
            torch.save(saved, out)
        # Both ranks done before either tears the group down: gloo aborts a process
        # (std::terminate) whose peer destroyed the group while its own threads still run.
        torch.distributed.barrier()
    finally:
        group.close()


def run_group(
    tmp: Path,
    size: int,
    source: str,
    steps: list[Any],
    *,
    poison: bool = True,
    device: str = "cpu",
) -> list[Any]:
    """Run ``steps`` on ``size`` spawned ranks meeting in ``tmp``; rank 0's logits per step."""
    import torch

    store, out = tmp / f"group-{size}.store", tmp / f"logits-{size}.pt"
    procs = [
        SPAWN.Process(target=run_rank, args=(r, size, str(store), source, steps, str(out), poison))
        for r in range(size)
    ]
    for proc in procs:
        proc.start()
    codes = [finish(proc, timeout=120) for proc in procs]
    assert codes == [0] * size, f"ranks exited with {codes}"
    saved: list[Any] = torch.load(out)
    return saved

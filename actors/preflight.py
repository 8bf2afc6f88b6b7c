"""The fenced topology's preflight: the checks ``ringfence launch`` runs before a run exists.

The supervisor runs a topology's preflight checks by import path before it creates any
process or shared-memory name (``runtime/topology.py``), so that a run the Worker would
refuse in ``on_start`` is refused at once, as the command's one-line error (exit 2)
naming the file and the field or tensor at fault. :func:`check_model` reads only
headers and JSON (the checkpoint's config.json and its safetensors headers, or a GGUF
file's metadata and tensor headers; never a tensor's bytes) and imports torch only when
``model.device`` is a CUDA device or ``transfer.copy`` is ``kernel``.
"""

from __future__ import annotations

import os
from pathlib import Path

from ringfence.actors.config import Config
from ringfence.actors.kv.layout import kv_layout
from ringfence.actors.model.checkpoint import check_checkpoint
from ringfence.actors.model.parallel import check_divisible
from ringfence.actors.model.shape import PRESETS, ModelShape
from ringfence.actors.text.gguf_metadata import is_gguf
from ringfence.cache.fences import Tier

SHM_DIR = "/dev/shm"  # where the CPU KV pools are created (POSIX shared memory)


def check_model(config: Config) -> None:
    """ValueError naming the file and field (or setting) when the Worker could not run
    ``[model]`` with this ``[cache]`` and ``[parallel]``: the checkpoint (its path,
    config.json, architecture, shard files, tensor names, shapes and dtypes; its tokenizer
    and chat template), the KV heads
    against ``parallel.tp_size``, ``cache.block_size`` against the model's positions, the
    KV pools against the room in /dev/shm, ``model.dtype`` on ``model.device``, and
    ``transfer.copy = "kernel"`` there."""
    shape = checkpoint_shape(config.model.path) if config.model.path else None
    if config.model.path:
        check_tokenizer(Path(config.model.path))
    shape = shape or PRESETS[config.model.preset]
    check_divisible(shape, config.parallel.tp_size)
    check_cache(config, shape)
    check_device(config.model.device, config.model.dtype, config.parallel.tp_size)
    if config.transfer.copy == "kernel":
        check_copy_kernel(config.model.device)
    check_launch_ahead(config)


def check_launch_ahead(config: Config) -> None:
    """ValueError for ``model.launch_ahead`` "on" or "late" where the Worker cannot launch ahead:
    under tensor parallelism (a step's collectives hold every rank) or the legacy lock (its
    exclusion covers a step's device work whole), or with the look-ahead off (it launches
    the plans the look-ahead checked)."""
    model = config.model
    if model.launch_ahead not in ("on", "late"):
        return
    named = f"model.launch_ahead={model.launch_ahead}"
    if config.parallel.tp_size > 1:
        raise ValueError(
            f"{named}: the Worker launches ahead on one rank only, not at "
            f"parallel.tp_size={config.parallel.tp_size} (set it to auto or off)"
        )
    if config.transfer.mode == "lock":
        raise ValueError(
            f"{named}: not under transfer.mode=lock, whose lock covers a step's "
            "device work whole (set it to auto or off)"
        )
    if model.look_ahead == "off":
        raise ValueError(
            f"{named}: it launches the plans the look-ahead checked, and model.look_ahead is off"
        )


def checkpoint_shape(path: str) -> ModelShape:
    """The shape of the checkpoint at ``model.path`` (a directory, or a GGUF file), once
    every file of it checked out."""
    root = Path(path)
    if is_gguf(root):
        if not root.is_file():
            raise ValueError(f"model.path: {path}: no such GGUF file")
        return check_checkpoint(root)
    if not root.exists():
        raise ValueError(f"model.path: {path}: no such directory")
    if not root.is_dir():
        raise ValueError(f"model.path: {path}: not a directory")
    return check_checkpoint(root)


def check_tokenizer(root: Path) -> None:
    """The checkpoint's tokenizer.json and the configs its special tokens come from parse,
    and its chat template (if it has one) compiles: ValueError naming the file otherwise.
    A checkpoint may have neither (token ids in, token ids out)."""
    from ringfence.actors.text.chat import ChatTemplate, find_template
    from ringfence.actors.text.tokenizer import load_tokenizer

    load_tokenizer(root)
    if find_template(root)[0] is not None:
        ChatTemplate.from_checkpoint(root)


def check_cache(config: Config, shape: ModelShape) -> None:
    """The KV layouts at this config (``parallel.tp_size`` divides the KV heads), a block
    no longer than the model's positions, and the CPU pools within /dev/shm's free room."""
    block_size = config.cache.block_size
    if block_size > shape.max_position:
        raise ValueError(
            f"cache.block_size: {block_size} tokens exceeds the model's "
            f"{shape.max_position} positions (max_position_embeddings)"
        )
    device, host = kv_layout(config, Tier.DEVICE, shape), kv_layout(config, Tier.HOST, shape)
    ranks = config.parallel.tp_size
    pools = {"cache.host_blocks": host.nbytes * ranks}
    if config.model.device == "cpu":
        pools["cache.device_blocks"] = device.nbytes * ranks
    try:
        stat = os.statvfs(SHM_DIR)
    except OSError:
        return  # no /dev/shm to measure: creating the pools will say what is wrong
    free = stat.f_bavail * stat.f_frsize
    if sum(pools.values()) > free:
        sizes = ", ".join(f"{key} {nbytes / 2**20:.0f} MiB" for key, nbytes in pools.items())
        raise ValueError(
            f"cache: the KV pools ({sizes}) do not fit in the {free / 2**20:.0f} MiB free in "
            f"{SHM_DIR}"
        )


def check_device(device: str, dtype: str, ranks: int = 1) -> None:
    """``model.device`` exists and runs ``model.dtype``; torch is imported only for CUDA.
    On CUDA, rank r runs on device index + r: every one of them must exist.

    Every dtype of ``[model]`` runs on the CPU (bfloat16 included: slower, not refused)."""
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"model.device: {device!r}, but torch sees no CUDA device")
    index = torch.device(device).index or 0
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"model.device: {device!r}, but torch sees {count} CUDA device(s)")
    if index + ranks > count:
        raise ValueError(
            f"parallel.tp_size: {ranks} ranks from {device!r} need CUDA devices "
            f"{index}..{index + ranks - 1}, but torch sees {count}"
        )
    if dtype == "bfloat16" and torch.cuda.get_device_capability(index) < (8, 0):
        # Before compute capability 8.0 bfloat16 is only emulated, if at all.
        name = torch.cuda.get_device_name(index)
        raise ValueError(f"model.dtype: bfloat16 is not supported on {device} ({name})")


def check_copy_kernel(device: str) -> None:
    """``transfer.copy = "kernel"`` runs on ``model.device``: Triton is installed, and on the
    CPU it runs in its interpreter. The swap lane's own rule (``kv/copies.py``), applied
    before the lane exists; ValueError naming the setting."""
    import torch

    from ringfence.actors.kv.copies import resolve_copy

    resolve_copy("kernel", torch.device(device))

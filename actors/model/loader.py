"""Loading the model the ``[model]`` section names, with what the engine must know of it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ringfence.actors.model.checkpoint import load_checkpoint
from ringfence.actors.model.config import ModelConfig
from ringfence.actors.model.decoder import Model
from ringfence.actors.model.dtypes import torch_dtype
from ringfence.actors.model.identity import model_id
from ringfence.actors.model.info import ModelInfo
from ringfence.actors.model.parallel import Group, Shard, rank_device
from ringfence.actors.text.tokenizer import ByteTokenizer, special_ids


class LoadedModel(NamedTuple):
    model: Model
    info: ModelInfo


def load_model(
    settings: ModelConfig, *, shard: Shard | None = None, group: Group | None = None
) -> LoadedModel:
    """The model the ``[model]`` section names: ``path`` (a checkpoint) before ``preset``;
    under tensor parallelism ``shard``'s part of it, on the rank's device
    (``parallel.rank_device``), its all-reduces through ``group``."""
    dtype = torch_dtype(settings.dtype)
    shard = shard or Shard()
    device = rank_device(settings.device, shard.rank)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"model.device is {device!r} but torch sees no CUDA device")
    if settings.path:
        model = load_checkpoint(settings.path, dtype=dtype, device=device, shard=shard, group=group)
        bos, eos = special_ids(settings.path)
    else:
        model = Model.from_preset(
            settings.preset, dtype, settings.seed, shard=shard, group=group
        ).to(device)
        bos, eos = ByteTokenizer.bos, ByteTokenizer.eos
    info = ModelInfo(
        model_id=model_id(settings),
        vocab_size=model.config.vocab_size,
        max_position=model.config.max_position,
        dtype=settings.dtype,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    return LoadedModel(model.eval(), info)

"""Checking and loading a GGUF file: llama.cpp's single-file checkpoint, as another source.

A GGUF file holds what a checkpoint directory spreads over config.json, the tokenizer's
files (``gguf_tokenizer.py``) and the safetensors shards: the config as metadata
(``llama.block_count``, ``llama.embedding_length``...) and the tensors under llama.cpp's
names (``token_embd``, ``blk.N.attn_q``...), most of them quantized. It is read with the
``gguf`` package's reader (a read-only memory map) and dequantized with its own routines
(``gguf.quants.dequantize``): ringfence has no quantized kernels, so the weights are
dequantized to ``model.dtype`` at load and a Q4 file takes that dtype's memory.

Names map back to the Hugging Face Llama layout. llama.cpp's converter permutes the rows
of ``attn_q`` and ``attn_k`` within each head (its rotary pairs adjacent elements,
transformers' the two halves of a head); :func:`unpermute` undoes that exactly as
transformers' ``LlamaTensorProcessor._reverse_permute_weights`` does. A file without
``output.weight`` has tied embeddings. Under tensor parallelism a rank dequantizes each
whole tensor and keeps its slice (``parallel.take_shard``), as it would of a safetensors
tensor. The metadata and the cached reader are the text room's (``actors/text/gguf_metadata.py``):
the tokenizer and the chat template read them without torch.
"""

from __future__ import annotations

import functools
import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING

from ringfence.actors.model.families import FAMILIES, shape_of
from ringfence.actors.model.shape import ModelShape, expected_tensors
from ringfence.actors.text.gguf_metadata import metadata, reader

if TYPE_CHECKING:
    import torch
    from gguf import ReaderTensor

    from ringfence.actors.model.decoder import Model
    from ringfence.actors.model.parallel import Group, Shard

# general.architecture -> the Hugging Face architecture whose layout the tensors map to.
ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# llama.cpp's tensor names -> the state-dict names of the Llama layout.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
_HASH_CHUNK = 1 << 20


def hf_name(name: str) -> str | None:
    """The Llama state-dict name of llama.cpp tensor ``name`` (None: not a Llama tensor)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER.fullmatch(name)
    if match is None or match[2] not in _LAYER_NAMES:
        return None
    return f"model.layers.{int(match[1])}.{_LAYER_NAMES[match[2]]}"


def gguf_name(name: str) -> str:
    """llama.cpp's name of Llama state-dict tensor ``name`` (the inverse of :func:`hf_name`)."""
    for theirs, ours in _GLOBAL_NAMES.items():
        if ours == name:
            return theirs
    _, _, index, rest = name.split(".", 3)  # model.layers.N.rest
    return f"blk.{index}.{next(k for k, v in _LAYER_NAMES.items() if v == rest)}"


def _int(path: Path, key: str, default: int | None = None) -> int:
    value = metadata(path, key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path}: {key}: must be a positive integer, got {value!r}")
    return value


def _float(path: Path, key: str, default: float) -> float:
    value = metadata(path, key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{path}: {key}: must be a number, got {value!r}")
    return float(value)


def gguf_shape(path: str | Path) -> ModelShape:
    """The ``ModelShape`` the file's metadata describes; ValueError naming the file and the
    key (or the architecture) it refuses. Reads no tensor data."""
    file = Path(path)
    arch = metadata(file, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{file}: general.architecture: {arch!r} is not supported; supported: "
            f"{sorted(ARCHITECTURES)}"
        )
    scaling = metadata(file, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"{file}: {arch}.rope.scaling.type: {scaling!r} is not supported")
    tokens = metadata(file, "tokenizer.ggml.tokens")
    heads = _int(file, f"{arch}.attention.head_count")
    hidden = _int(file, f"{arch}.embedding_length")
    names = {tensor.name for tensor in reader(file).tensors}
    raw = {
        "architectures": [ARCHITECTURES[arch]],
        # transformers takes the vocabulary's size from the token list.
        "vocab_size": len(tokens) if tokens else _int(file, f"{arch}.vocab_size"),
        "hidden_size": hidden,
        "num_hidden_layers": _int(file, f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": _int(file, f"{arch}.attention.head_count_kv", heads),
        # transformers reads rope.dimension_count as head_dim (llama and mistral).
        "head_dim": _int(file, f"{arch}.rope.dimension_count", hidden // heads),
        "intermediate_size": _int(file, f"{arch}.feed_forward_length"),
        "max_position_embeddings": _int(file, f"{arch}.context_length"),
        "rope_theta": _float(file, f"{arch}.rope.freq_base", 10_000.0),
        "rms_norm_eps": _float(file, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        "tie_word_embeddings": "output.weight" not in names,
    }
    try:
        return shape_of(raw)
    except ValueError as exc:
        raise ValueError(f"{file}: {exc}") from None


@functools.cache
def _dequantizable(qtype: int) -> bool:
    """Whether ``gguf.quants.dequantize`` knows type ``qtype`` (tried on one zero block)."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    kind = GGMLQuantizationType(qtype)
    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[kind][1]), dtype=np.uint8), kind)
    except NotImplementedError:
        return False
    return True


def checked_tensors(path: str | Path, shape: ModelShape) -> dict[str, ReaderTensor]:
    """The file's tensors by Llama state-dict name, each checked: a name llama.cpp gives a
    Llama tensor, every tensor of ``shape`` present (``output.weight`` only when untied),
    its shape, and a type ``gguf.quants`` dequantizes. ValueError naming the file and the
    tensor (llama.cpp's name) otherwise. Reads headers only."""
    file = Path(path)
    needed = expected_tensors(shape)
    if shape.tie_embeddings:
        del needed["lm_head.weight"]  # the embedding itself
    found: dict[str, ReaderTensor] = {}
    for tensor in reader(file).tensors:
        name = hf_name(tensor.name)
        if name is None or name not in needed:
            raise ValueError(f"{file}: tensor {tensor.name!r} is not one the Llama model has")
        rows_first = tuple(reversed([int(d) for d in tensor.shape]))  # ggml lists columns first
        if rows_first != needed[name]:
            raise ValueError(
                f"{file}: tensor {tensor.name!r} has shape {list(rows_first)}, the model needs "
                f"{list(needed[name])} (rows first)"
            )
        if not _dequantizable(int(tensor.tensor_type)):
            raise ValueError(
                f"{file}: tensor {tensor.name!r} is of type {tensor.tensor_type.name}, which "
                "gguf.quants cannot dequantize"
            )
        found[name] = tensor
    missing = [gguf_name(name) for name in needed if name not in found]
    if missing:
        raise ValueError(f"{file}: the GGUF file lacks tensors {missing}")
    return found


def check_gguf(path: str | Path) -> ModelShape:
    """The file's ``ModelShape`` once its metadata and every tensor's header check out."""
    shape = gguf_shape(path)
    checked_tensors(path, shape)
    return shape


def unpermute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's row order of a q or k projection of ``heads`` heads: within each head
    it interleaves the two halves (row i of the first half, then row i of the second)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def dequantized(tensor: ReaderTensor, name: str, shape: ModelShape) -> torch.Tensor:
    """The float32 value of ``tensor`` in the Llama layout of state-dict tensor ``name``."""
    import numpy as np
    import torch
    from gguf.quants import dequantize

    values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    weight = torch.from_numpy(values.reshape(tuple(reversed([int(d) for d in tensor.shape]))))
    if name.endswith("self_attn.q_proj.weight"):
        return unpermute(weight, shape.heads)
    if name.endswith("self_attn.k_proj.weight"):
        return unpermute(weight, shape.kv_heads)
    return weight


def load_gguf(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    shard: Shard | None = None,
    group: Group | None = None,
) -> Model:
    """A ``Model`` holding the file's weights dequantized to ``dtype`` (float32 by default)
    on ``device``: the checks of :func:`check_gguf`, then, under tensor parallelism, the
    rank's slice of each dequantized tensor."""
    import torch

    from ringfence.actors.model.decoder import Model
    from ringfence.actors.model.parallel import Shard, take_shard

    shard = shard or Shard()
    shape = gguf_shape(path)
    tensors = checked_tensors(path, shape)
    dtype = torch.float32 if dtype is None else dtype
    # No random weights: every parameter is set below (a tied lm_head is the embedding).
    model = Model(shape, dtype, seed=None, shard=shard, group=group)
    targets = model.state_dict(keep_vars=True)
    tied = {"lm_head.weight"} if shape.tie_embeddings else set()
    if set(targets) != set(tensors) | tied:  # one definition of the tensors
        raise RuntimeError(f"the {shape.family} model's state dict differs from expected_tensors")
    for name, tensor in tensors.items():
        with torch.no_grad():
            targets[name].copy_(take_shard(name, dequantized(tensor, name, shape), shard))
    return model.to(device)


def gguf_fingerprint_id(path: str | Path) -> str:
    """A stable id of the model and its weights: the family's slug and BLAKE2b over the file."""
    digest = hashlib.blake2b(digest_size=16)
    with Path(path).open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return f"{FAMILIES[gguf_shape(path).family].slug}-blake2b-{digest.hexdigest()}"

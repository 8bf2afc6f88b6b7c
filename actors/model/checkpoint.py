"""Loading a Hugging Face ``LlamaForCausalLM`` checkpoint directory into our ``Model``.

A checkpoint is ``config.json`` plus ``model.safetensors`` or shards listed by
``model.safetensors.index.json``, and optionally ``tokenizer.json``. The safetensors
files are parsed here rather than through the ``safetensors`` package. Byte layout of
one file (all integers little-endian)::

    [0, 8)        u64 N: length of the header
    [8, 8+N)      JSON object {name: {"dtype", "shape", "data_offsets": [begin, end]}}
                  and an optional "__metadata__" entry of strings
    [8+N, EOF)    tensor data; data_offsets are relative to 8+N, row-major, little-endian
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from ringfence.actors.model.shape import ModelShape

if TYPE_CHECKING:  # torch is imported by what reads tensors, not by what reads configs
    import torch

    from ringfence.actors.model.decoder import Model

HEADER_LENGTH = struct.Struct("<Q")  # the u64 N in front of the JSON header
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit on N
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# safetensors dtype -> (torch dtype name, bytes per element)
SAFETENSORS_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
}
# Non-parameter buffers that older checkpoints saved; derived from the config, so skipped.
_DERIVED_SUFFIX = ".self_attn.rotary_emb.inv_freq"
_HASH_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorEntry:
    """Where one tensor's bytes lie in a safetensors file."""

    file: Path  # the file holding it
    dtype: str  # stored element type: a key of SAFETENSORS_DTYPES
    shape: tuple[int, ...]  # stored shape
    begin: int  # absolute byte offset of the first element in the file
    end: int  # absolute byte offset one past the last element


def _config_error(key: str, message: str) -> ValueError:
    return ValueError(f"config.json: {key}: {message}")


def _int_key(raw: dict[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key)
    value = default if value is None else value  # null counts as absent, as in transformers
    if value is None:
        raise _config_error(key, "is required")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _config_error(key, f"must be an integer, got {value!r}")
    return value


def _float_key(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _config_error(key, f"must be a number, got {value!r}")
    return float(value)


def read_config(path: str | Path) -> ModelShape:
    """The ``ModelShape`` of a checkpoint's ``config.json``; refuses what we do not implement."""
    file = Path(path) / "config.json"
    try:
        raw = orjson.loads(file.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"{file}: cannot read the model config: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: the model config is not a JSON object")
    if raw.get("architectures") != ["LlamaForCausalLM"]:
        raise _config_error(
            "architectures",
            f"only ['LlamaForCausalLM'] is supported, got {raw.get('architectures')!r}",
        )
    if raw.get("rope_scaling") is not None:
        raise _config_error("rope_scaling", f"is not supported, got {raw['rope_scaling']!r}")
    rope = raw.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise _config_error("rope_parameters", f"must be an object, got {rope!r}")
    if rope.get("rope_type", "default") != "default":
        raise _config_error("rope_parameters.rope_type", f"only 'default' is supported, got {rope}")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key, False):
            raise _config_error(key, "biases are not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise _config_error("hidden_act", f"only 'silu' is supported, got {raw['hidden_act']!r}")
    if raw.get("quantization_config") is not None:
        raise _config_error("quantization_config", "quantized weights are not supported")
    max_position = _int_key(raw, "max_position_embeddings")
    if max_position < 2048:
        raise _config_error(
            "max_position_embeddings",
            f"is {max_position}, but ModelShape.max_position must be >= 2048 and raising it "
            "would admit positions the checkpoint was never configured for",
        )
    hidden = _int_key(raw, "hidden_size")
    heads = _int_key(raw, "num_attention_heads")
    rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10_000.0))
    try:
        return ModelShape(
            vocab_size=_int_key(raw, "vocab_size"),
            hidden=hidden,
            layers=_int_key(raw, "num_hidden_layers"),
            heads=heads,
            kv_heads=_int_key(raw, "num_key_value_heads", heads),
            head_dim=_int_key(raw, "head_dim", hidden // heads if heads > 0 else None),
            intermediate=_int_key(raw, "intermediate_size"),
            max_position=max_position,
            rope_theta=_float_key("rope_theta", rope_theta),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            norm_eps=_float_key("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{file}: {exc}") from exc


def read_safetensors_header(file: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, validated against the file's size."""
    size = file.stat().st_size
    with file.open("rb") as f:
        head = f.read(HEADER_LENGTH.size)
        if len(head) < HEADER_LENGTH.size:
            raise ValueError(f"{file}: {size} bytes is too short for a safetensors header")
        (length,) = HEADER_LENGTH.unpack(head)
        if length > min(MAX_HEADER_BYTES, size - HEADER_LENGTH.size):
            raise ValueError(f"{file}: header length {length} runs past the end ({size} bytes)")
        try:
            header = orjson.loads(f.read(length))
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{file}: the header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{file}: the header is not a JSON object")
    data_start = HEADER_LENGTH.size + length
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{file}: tensor {name!r}"
        if not isinstance(info, dict) or info.get("dtype") not in SAFETENSORS_DTYPES:
            dtype = info.get("dtype") if isinstance(info, dict) else info
            raise ValueError(
                f"{where}: unsupported dtype {dtype!r}; known {list(SAFETENSORS_DTYPES)}"
            )
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(f"{where}: malformed shape {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ValueError(f"{where}: malformed data_offsets {offsets!r}")
        dtype = info["dtype"]
        expected = math.prod(shape) * SAFETENSORS_DTYPES[dtype][1]
        if offsets[1] - offsets[0] != expected:
            raise ValueError(
                f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, but "
                f"shape {shape} of {info['dtype']} needs {expected}"
            )
        if data_start + offsets[1] > size:
            raise ValueError(f"{where}: data_offsets {offsets} run past the end ({size} bytes)")
        entries[name] = TensorEntry(
            file=file,
            dtype=dtype,
            shape=tuple(shape),
            begin=data_start + offsets[0],
            end=data_start + offsets[1],
        )
    return entries


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's weight files: the shards of the index, or the single file."""
    root = Path(path)
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map = orjson.loads(index.read_bytes())["weight_map"]
            return [root / name for name in sorted(set(weight_map.values()))]
        except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index}: malformed index (no weight_map): {exc!r}") from exc
    if (root / SINGLE_FILE).exists():
        return [root / SINGLE_FILE]
    raise ValueError(f"{root}: neither {SINGLE_FILE} nor {INDEX_FILE} is present")


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """The tensor's stored values, in its stored dtype and shape (a fresh copy)."""
    import torch

    dtype = getattr(torch, SAFETENSORS_DTYPES[entry.dtype][0])
    if sys.byteorder != "little":
        raise ValueError("safetensors data is little-endian; this host is not")
    buffer = bytearray(entry.end - entry.begin)
    with entry.file.open("rb") as f:
        f.seek(entry.begin)
        if f.readinto(buffer) != len(buffer):
            raise ValueError(f"{entry.file}: short read at offset {entry.begin}")
    if not buffer:
        return torch.empty(entry.shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).reshape(entry.shape)


def _all_entries(files: Iterable[Path]) -> dict[str, TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    for file in files:
        for name, entry in read_safetensors_header(file).items():
            if name in entries:
                raise ValueError(f"tensor {name!r} is in both {entries[name].file} and {file}")
            entries[name] = entry
    return entries


def load_checkpoint(
    path: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> Model:
    """A ``Model`` holding the checkpoint's weights, cast to ``dtype``, on ``device``.

    Every parameter must be present with its exact shape; a tied checkpoint may omit
    ``lm_head.weight``. The files are only read. ``dtype`` defaults to float32.
    """
    import torch

    from ringfence.actors.model.decoder import Model

    config = read_config(path)
    entries = _all_entries(safetensors_files(path))
    # The random initial weights are all overwritten below.
    model = Model(config, torch.float32 if dtype is None else dtype, seed=0)
    targets = model.state_dict(keep_vars=True)
    optional = {"lm_head.weight"} if config.tie_embeddings else set()
    missing = sorted(set(targets) - set(entries) - optional)
    if missing:
        raise ValueError(f"{path}: checkpoint lacks tensors {missing}")
    unexpected = sorted(n for n in entries if n not in targets and not n.endswith(_DERIVED_SUFFIX))
    if unexpected:
        raise ValueError(f"{path}: checkpoint has tensors the model does not: {unexpected}")
    for name, param in targets.items():
        entry = entries.get(name)
        if entry is None:
            continue
        if entry.shape != tuple(param.shape):
            raise ValueError(
                f"{entry.file}: tensor {name!r} has shape {list(entry.shape)}, "
                f"the model needs {list(param.shape)}"
            )
        if config.tie_embeddings and name == "lm_head.weight":
            # Tied: the parameter is the embedding, so a stored copy must agree with it.
            embed = read_tensor(entries["model.embed_tokens.weight"])
            if not torch.equal(read_tensor(entry), embed):
                raise ValueError(f"{path}: embeddings are tied but lm_head.weight differs")
            continue
        with torch.no_grad():
            param.copy_(read_tensor(entry))
    return model.to(device)


def checkpoint_fingerprint_id(path: str | Path) -> str:
    """A stable id of the model and its weights: BLAKE2b over config.json and every weight byte.

    Reads all weight files (seconds per GB). Headers alone would give two fine-tunes of one
    architecture the same id, and their KV caches must never be shared.
    """
    root = Path(path)
    digest = hashlib.blake2b(digest_size=16)
    digest.update((root / "config.json").read_bytes())
    for file in safetensors_files(root):
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    return f"llama-blake2b-{digest.hexdigest()}"

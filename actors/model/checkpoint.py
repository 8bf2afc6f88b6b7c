"""Checking and loading a Hugging Face checkpoint directory of a supported family (or, through
``gguf_checkpoint.py``, a GGUF file: each public function here takes either).

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
from typing import TYPE_CHECKING

import orjson

from ringfence.actors.model.families import FAMILIES, read_config
from ringfence.actors.model.gguf_checkpoint import (
    check_gguf,
    gguf_fingerprint_id,
    load_gguf,
)
from ringfence.actors.model.shape import ModelShape, expected_tensors
from ringfence.actors.text.gguf_metadata import is_gguf

if TYPE_CHECKING:  # torch is imported by what reads tensors, not by what reads configs
    import torch

    from ringfence.actors.model.decoder import Model
    from ringfence.actors.model.parallel import Group, Shard

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


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = orjson.loads(index.read_bytes())["weight_map"]
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{index}: malformed index (no weight_map): {exc!r}") from exc
    if not isinstance(weight_map, dict) or not all(
        isinstance(name, str) and isinstance(file, str) and file and "/" not in file
        for name, file in weight_map.items()
    ):
        raise ValueError(f"{index}: weight_map must map tensor names to file names in its folder")
    return weight_map


def safetensors_files(path: str | Path) -> list[Path]:
    """The checkpoint's weight files: the shards of the index, or the single file.

    Every shard the index names must exist (ValueError naming the missing file).
    """
    root = Path(path)
    index = root / INDEX_FILE
    if index.exists():
        files = [root / name for name in sorted(set(_weight_map(index).values()))]
        for file in files:
            if not file.is_file():
                raise ValueError(f"{index}: weight_map names {file.name}, but {file} is missing")
        return files
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


def read_tensor_slice(entry: TensorEntry, dim: int, start: int, length: int) -> torch.Tensor:
    """Elements ``start .. start+length-1`` along ``dim`` of the stored tensor (a fresh copy),
    reading only their bytes: one read for a run of rows (``dim`` 0), one read per row for
    a run of columns (``dim`` 1 of a matrix)."""
    import torch

    dtype = getattr(torch, SAFETENSORS_DTYPES[entry.dtype][0])
    itemsize = SAFETENSORS_DTYPES[entry.dtype][1]
    shape = entry.shape
    if not 0 <= dim < len(shape) or not 0 <= start <= start + length <= shape[dim]:
        raise ValueError(f"{entry.file}: no slice {start}+{length} along {dim} of {list(shape)}")
    if sys.byteorder != "little":
        raise ValueError("safetensors data is little-endian; this host is not")
    inner = math.prod(shape[dim + 1 :]) * itemsize  # bytes of one step along dim
    outer = math.prod(shape[:dim])  # runs to read: 1 for rows, one per row for columns
    run, stride = length * inner, shape[dim] * inner
    buffer = bytearray(outer * run)
    view = memoryview(buffer)
    with entry.file.open("rb") as f:
        for i in range(outer):
            f.seek(entry.begin + i * stride + start * inner)
            if f.readinto(view[i * run : (i + 1) * run]) != run:
                raise ValueError(f"{entry.file}: short read at offset {f.tell()}")
    out_shape = (*shape[:dim], length, *shape[dim + 1 :])
    if not buffer:
        return torch.empty(out_shape, dtype=dtype)
    return torch.frombuffer(buffer, dtype=dtype).reshape(out_shape)


def _all_entries(files: Iterable[Path]) -> dict[str, TensorEntry]:
    entries: dict[str, TensorEntry] = {}
    for file in files:
        for name, entry in read_safetensors_header(file).items():
            if name in entries:
                raise ValueError(f"tensor {name!r} is in both {entries[name].file} and {file}")
            entries[name] = entry
    return entries


def _checked_entries(path: str | Path, shape: ModelShape) -> dict[str, TensorEntry]:
    """The checkpoint's tensors (headers only), checked against ``expected_tensors(shape)``.

    Every tensor of the model must be present with its exact shape, except a tied
    ``lm_head.weight``, which may be omitted; nothing else may be, but rotary ``inv_freq``
    buffers, which are derived from the config and skipped.
    """
    root = Path(path)
    entries = _all_entries(safetensors_files(root))
    index = root / INDEX_FILE
    if index.exists():
        for name, file in _weight_map(index).items():
            if name in entries and entries[name].file.name != file:
                raise ValueError(
                    f"{index}: weight_map puts tensor {name!r} in {file}, "
                    f"but it is in {entries[name].file}"
                )
    needed = expected_tensors(shape)
    optional = {"lm_head.weight"} if shape.tie_embeddings else set()
    missing = sorted(set(needed) - set(entries) - optional)
    if missing:
        raise ValueError(f"{root}: checkpoint lacks tensors {missing}")
    for name, entry in entries.items():
        if name not in needed and not name.endswith(_DERIVED_SUFFIX):
            raise ValueError(
                f"{entry.file}: tensor {name!r} is not one the {shape.family} model has"
            )
        if name in needed and entry.shape != needed[name]:
            raise ValueError(
                f"{entry.file}: tensor {name!r} has shape {list(entry.shape)}, "
                f"the model needs {list(needed[name])}"
            )
    return {name: entry for name, entry in entries.items() if name in needed}


def check_checkpoint(path: str | Path) -> ModelShape:
    """The checkpoint's ``ModelShape``, once its config and every tensor's header check out.

    Torch-free and reads no tensor data: config.json (``read_config``), the shards the
    index names (each must exist), and each safetensors header (every tensor the model
    needs, at its exact shape, in a supported dtype; no unexpected tensors). Whether a
    stored tied ``lm_head.weight`` equals the embedding needs the data: ``load_checkpoint``
    checks that. ValueError naming the file and the tensor or field otherwise.
    """
    if is_gguf(path):
        return check_gguf(path)
    shape = read_config(path)
    _checked_entries(path, shape)
    return shape


def load_checkpoint(
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    shard: Shard | None = None,
    group: Group | None = None,
) -> Model:
    """A ``Model`` holding the checkpoint's weights, cast to ``dtype``, on ``device``.

    The checks of ``check_checkpoint``, and a tied checkpoint's stored ``lm_head.weight``
    must equal its embedding. The files are only read. ``dtype`` defaults to float32.
    Under tensor parallelism (``shard``) only the rank's slice of each split tensor is
    read (``actors/model/parallel.py`` says which are split).
    """
    import torch

    from ringfence.actors.model.decoder import Model
    from ringfence.actors.model.parallel import Shard, shard_range

    if is_gguf(path):
        return load_gguf(path, dtype=dtype, device=device, shard=shard, group=group)
    shard = shard or Shard()
    config = read_config(path)
    entries = _checked_entries(path, config)
    # The random initial weights are all overwritten below.
    model = Model(
        config, torch.float32 if dtype is None else dtype, seed=0, shard=shard, group=group
    )
    targets = model.state_dict(keep_vars=True)
    if set(targets) != set(expected_tensors(config)):  # one definition of the tensors
        raise RuntimeError(f"the {config.family} model's state dict differs from expected_tensors")
    for name, entry in entries.items():
        if config.tie_embeddings and name == "lm_head.weight":
            # Tied: the parameter is the embedding, so a stored copy must agree with it.
            embed = read_tensor(entries["model.embed_tokens.weight"])
            if not torch.equal(read_tensor(entry), embed):
                raise ValueError(f"{path}: embeddings are tied but lm_head.weight differs")
            continue
        where = shard_range(name, entry.shape, shard)
        value = read_tensor(entry) if where is None else read_tensor_slice(entry, *where)
        with torch.no_grad():
            targets[name].copy_(value)
    return model.to(device)


def checkpoint_fingerprint_id(path: str | Path) -> str:
    """A stable id of the model and its weights: BLAKE2b over config.json and every weight byte.

    Reads all weight files (seconds per GB). Headers alone would give two fine-tunes of one
    architecture the same id, and their KV caches must never be shared. The id begins
    with the family's slug ("llama-", "qwen2-", ...).
    """
    if is_gguf(path):
        return gguf_fingerprint_id(path)
    root = Path(path)
    slug = FAMILIES[read_config(root).family].slug
    digest = hashlib.blake2b(digest_size=16)
    digest.update((root / "config.json").read_bytes())
    for file in safetensors_files(root):
        digest.update(file.name.encode() + b"\0")
        with file.open("rb") as f:
            while chunk := f.read(_HASH_CHUNK):
                digest.update(chunk)
    return f"{slug}-blake2b-{digest.hexdigest()}"

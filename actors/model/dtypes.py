"""The element types a model and its KV cache run in: config name -> bytes and torch dtype.

The names are ``model.dtype``'s choices. torch is imported where a dtype is asked for, not
with the module: the Engine and the supervisor size KV layouts without touching a tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ITEMSIZE: dict[str, int] = {"float32": 4, "bfloat16": 2, "float64": 8}  # bytes per element


def known_dtype(name: str) -> str:
    """``name`` if it is a dtype of :data:`ITEMSIZE`; ValueError naming the known ones."""
    if name not in ITEMSIZE:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(ITEMSIZE)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a config dtype name; ValueError naming the known ones."""
    import torch

    dtype = getattr(torch, known_dtype(name))
    assert isinstance(dtype, torch.dtype)
    return dtype

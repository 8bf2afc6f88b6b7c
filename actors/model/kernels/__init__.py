"""Triton kernels of the paged forward: attention that reads KV blocks where they lie (its
keys split among programs for a step of few sequences), the store of a step's new K/V into
their slots, and on a GPU the layer's small ops fused (the RMSNorm, alone and after the
residual add; the rotary embedding of q and k together; SiLU and the product of the gated
MLP), :func:`fused`.

Importing this package imports nothing heavy: ``triton_available`` looks for Triton without
importing it, so a plain install (no Triton) keeps the torch attention path. Only the kernel
modules import Triton: ``paged_attention.py``, ``split_keys.py`` and ``kv_store.py`` through
the Triton backend (``kernels/backend.py``), ``rms_norm.py``, ``rotary.py`` and
``activation.py`` through the paged executor on a GPU.

Where no CUDA device is present, importing this package sets Triton's own
``TRITON_INTERPRET`` variable (unless the caller set it): the kernels then run in Triton's
interpreter on CPU tensors, which is how they are tested on a machine without a GPU. It is
set here, at the import of ``actors/model/paged.py``, and not only before our own import of
Triton, because torch imports Triton itself the first time it builds a model (through
``torch._dynamo``), and Triton fixes the interpreter choice of its own helpers when it is
imported.
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ringfence.actors.model.decoder import Kernels

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_available() -> bool:
    """Whether Triton is installed (looked up, not imported: the import takes seconds)."""
    return importlib.util.find_spec("triton") is not None


def fused() -> Kernels:
    """The fused kernels of the forward, for ``Model.use_kernels`` (imports Triton)."""
    from ringfence.actors.model.decoder import Kernels
    from ringfence.actors.model.kernels.activation import silu_mul
    from ringfence.actors.model.kernels.rms_norm import add_rms_norm, rms_norm
    from ringfence.actors.model.kernels.rotary import rotate, rotate_qk

    return Kernels(rms_norm, add_rms_norm, rotate, rotate_qk, silu_mul)

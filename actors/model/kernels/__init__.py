"""Triton kernels of the paged forward: attention that reads KV blocks where they lie, the
store of a step's new K/V into their slots, and on a GPU the RMSNorm and the rotary embedding
fused into one kernel each.

Importing this package imports nothing heavy: ``triton_available`` looks for Triton without
importing it, so a plain install (no Triton) keeps the torch attention path. Only the kernel
modules import Triton: ``paged_attention.py`` through the Triton backend
(``kernels/backend.py``), ``rms_norm.py`` and ``rotary.py`` through the paged executor on a
GPU.

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

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def triton_available() -> bool:
    """Whether Triton is installed (looked up, not imported: the import takes seconds)."""
    return importlib.util.find_spec("triton") is not None

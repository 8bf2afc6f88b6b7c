"""How a step's attention reads the paged KV tensor: the backends, and which one a run uses.

A backend turns a step's pieces into a :class:`StepAttention` once, which every layer then
uses to write its new K/V and to attend. Two exist (``model.attention``):

- ``torch`` (``actors/model/torch_attention.py``): gathers each piece's blocks into
  contiguous tensors and calls SDPA. The reference, and the path of a plain install.
- ``triton`` (``actors/model/kernels/backend.py``): Triton kernels that read the blocks where
  they lie, one launch per layer for the whole step; the only backend a captured CUDA graph
  can replay (``actors/model/graphs.py``).

``auto`` picks ``triton`` on a CUDA device when Triton is installed and the KV is not
float64 (float64 is the exactness dtype, and Triton's float64 dot is not what GPUs are
built for), else ``torch``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

import torch
from torch import Tensor

from ringfence.actors.model.config import Attention
from ringfence.actors.model.decoder import Model, Residual
from ringfence.actors.model.kernels import triton_available
from ringfence.sched.ops import Piece

Backend = Literal["torch", "triton"]


class StepAttention(Protocol):
    """One step's attention, prepared from its pieces; used by each layer in turn.

    ``write`` mutates the KV tensor at the step's slots only; ``attend`` reads each piece's
    positions 0..start+len-1 and nothing else of it. Owned by the one caller of the step.
    """

    def write(self, layer: int, k: Tensor, v: Tensor) -> None:
        """Store layer ``layer``'s k, v [T, kv_heads, head_dim] into the tokens' slots."""

    def attend(self, layer: int, q: Tensor) -> Tensor:
        """Attention of q [T, heads, head_dim] over layer ``layer``: [T, heads * head_dim]."""
        ...


class AttentionBackend(Protocol):
    """Makes the :class:`StepAttention` of a step; holds the model's shape and the KV tensor."""

    def prepare(self, pieces: Sequence[Piece]) -> StepAttention:
        """The step's index tensors, built once on the KV tensor's device."""
        ...


def resolve_attention(choice: Attention, kv: Tensor) -> Backend:
    """The backend ``choice`` means for a KV tensor: ``auto`` as the module docstring says;
    ``triton`` without Triton installed, or on a CPU KV outside Triton's interpreter, is a
    ValueError naming the setting."""
    if choice == "torch":
        return "torch"
    if choice == "triton":
        if not triton_available():
            raise ValueError(
                "model.attention is 'triton' but Triton is not installed (pip install triton, "
                "or model.attention=torch)"
            )
        if kv.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                f"model.attention is 'triton' with the KV on {kv.device}: Triton runs there only "
                "in its interpreter (TRITON_INTERPRET=1, set by default where no CUDA device is "
                "present)"
            )
        return "triton"
    if choice != "auto":
        raise ValueError(f"model.attention must be auto, torch or triton, got {choice!r}")
    on_gpu = kv.device.type == "cuda" and kv.dtype != torch.float64
    return "triton" if on_gpu and triton_available() else "torch"


def _torch(model: Model, kv: Tensor, splits: int) -> AttentionBackend:
    from ringfence.actors.model.torch_attention import TorchAttention

    return TorchAttention(model, kv)  # SDPA over gathered keys: nothing to split


def _triton(model: Model, kv: Tensor, splits: int) -> AttentionBackend:
    from ringfence.actors.model.kernels.backend import TritonAttention

    return TritonAttention(model, kv, splits=splits)


# Imported on use: the Triton backend imports Triton (seconds), which a torch run never needs.
# Each is made of the model, its KV and the most programs a decode's keys are split among.
BACKENDS: dict[Backend, Callable[[Model, Tensor, int], AttentionBackend]] = {
    "torch": _torch,
    "triton": _triton,
}


def run_layers(model: Model, x: Tensor, positions: Tensor, attention: StepAttention) -> Tensor:
    """The hidden states after every layer of ``model``, from the embedded tokens x [T, hidden]
    at ``positions`` [T]; each layer writes its K/V and attends through ``attention``. What
    an eager step runs, and what a CUDA graph captures."""
    rope = model.rope(positions)  # once a step, for every layer
    stream: Tensor | Residual = x
    for layer in range(model.local.layers):
        x, h = model.layer_input(layer, stream)  # the layer before's output added
        q, k, v = model.attention_inputs(layer, h, rope)
        # Write before reading: a piece's queries attend to its own new tokens too.
        attention.write(layer, k, v)
        stream = model.finish_layer(layer, x, attention.attend(layer, q))
    return stream.whole() if isinstance(stream, Residual) else stream

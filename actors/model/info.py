"""What a loaded model announces: the facts the Engine needs and cannot derive itself."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelInfo:
    """What the engine needs to know about the worker's model (a field of ``WorkerReady``)."""

    model_id: str  # weights identity (the block keys' fingerprint uses it)
    vocab_size: int
    max_position: int
    dtype: str
    bos_token_id: int | None
    eos_token_id: int | None

"""Copies between the host and the device that never make the host wait for the device.

On CUDA, torch's copy of a pageable CPU tensor to the GPU (``to(device)``, ``copy_``,
``torch.tensor(..., device=...)``) ends with a synchronization of the stream: the host waits
until every kernel queued before it has run. In a Worker with two steps in flight, that is
the step before's whole forward, so the next step's kernels are queued only once the device
has gone idle. Copied from pinned memory with ``non_blocking``, the copy is queued behind
them instead, and the host goes on. The pinned block comes from torch's caching host
allocator, which records the copy's event and hands the block out again only once the copy
has run, so the source needs no care. Elsewhere (the CPU) a tensor already on the device is
returned as it is.
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(host: Tensor, device: torch.device) -> Tensor:
    """``host`` (a CPU tensor the caller no longer writes) on ``device``, queued on CUDA."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def copy_in(target: Tensor, host: Tensor) -> None:
    """``host`` copied into ``target`` (on any device), queued on CUDA: stream-ordered after
    whatever reads ``target`` before it."""
    if target.device.type == "cuda":
        target.copy_(host.pin_memory(), non_blocking=True)
    else:
        target.copy_(host)


def to_host(device: Tensor) -> tuple[Tensor, torch.cuda.Event | None]:
    """``device`` copied back to the host without making the host wait, and the event to
    wait on before reading the copy (None: it is the tensor itself, on the CPU). On CUDA the
    copy lands in pinned memory, queued behind the kernels that compute ``device``; the
    event covers it and them, but not kernels queued after it (a next step launched before
    this one's tokens are read: ``actors/executors/worker.py``). Waiting on the stream
    instead would wait for those too."""
    if device.device.type != "cuda":
        return device, None
    host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
    host.copy_(device, non_blocking=True)
    ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
    ready.record(torch.cuda.current_stream(device.device))
    return host, ready

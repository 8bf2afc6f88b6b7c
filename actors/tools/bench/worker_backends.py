"""``bench worker``'s attention backends side by side, against the roofline.

Each variant is the paged path with one setting of ``model.attention`` and
``model.cuda_graphs`` (:data:`VARIANTS`), timed on the same prompts and contexts as the
paged side (``worker_sides.Sides``): milliseconds of a prefill step and of a decode step,
medians over the rounds after one untimed round (Triton compiles, graphs are captured).
Their greedy decode tokens are compared with the first variant's.

The roofline is ``bench decode``'s (``decode_inproc.py``): the bytes a decode step reads
(every weight once, the K and V of every sequence's context once, at the mean context of the
timed steps) over the device's copy bandwidth, measured in the same run; each step's time is
reported as a multiple of that floor (1.0 is the hardware's pace).
"""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from ringfence.actors.tools.bench.decode_inproc import copy_bandwidth, step_bytes
from ringfence.actors.tools.bench.worker_sides import Sides

if TYPE_CHECKING:
    from ringfence.actors.model.decoder import Model

VARIANTS: dict[str, dict[str, Any]] = {
    "torch": {"attention": "torch", "cuda_graphs": False},
    "triton": {"attention": "triton", "cuda_graphs": False},
    "triton+graphs": {"attention": "triton", "cuda_graphs": True},
}


def default_variants(device: Any) -> list[str]:
    """Every variant the device runs at its own pace: all three on CUDA with Triton, torch
    alone on CUDA without it, none on the CPU (there Triton runs in its interpreter, for
    tests; ``--backends`` still asks for it)."""
    from ringfence.actors.model.kernels import triton_available

    if device.type != "cuda":
        return []
    return list(VARIANTS) if triton_available() else ["torch"]


def parse_variants(text: str) -> list[str]:
    """``--backends``: comma-separated names of :data:`VARIANTS` (ValueError naming it)."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown:
        raise ValueError(f"--backends: unknown {unknown}; known: {', '.join(VARIANTS)}")
    return names


def time_variants(
    model: Model, hf: Any, counts: dict[str, int], names: list[str]
) -> dict[str, dict[str, float]]:
    """Per variant: median ``prefill_ms`` and ``decode_step_ms``, and the fraction of its
    greedy decode tokens equal to the first variant's."""
    results: dict[str, dict[str, float]] = {}
    first_tokens: list[int] | None = None
    for name in names:
        sides = Sides(model, hf, counts, VARIANTS[name])
        sides.paged_prefill()  # untimed: compiles, captures, allocator
        sides.paged_decode()
        prefill = [sides.paged_prefill() for _ in range(counts["rounds"])]
        decode = [sides.paged_decode() for _ in range(counts["rounds"])]
        tokens = [t for step in sides.paged_tokens for t in step]
        first_tokens = tokens if first_tokens is None else first_tokens
        same = sum(a == b for a, b in zip(tokens, first_tokens, strict=True)) / len(tokens)
        results[name] = {
            "prefill_ms": statistics.median(prefill) * 1e3,
            "decode_step_ms": statistics.median(decode) * 1e3 / counts["decode_steps"],
            "greedy_tokens_equal_to_first": same,
        }
    return results


def roofline(torch: Any, model: Model, counts: dict[str, int]) -> dict[str, Any]:
    """The copy bandwidth (GB/s), the bytes of a timed decode step, and its floor (ms)."""
    device = next(model.parameters()).device
    bandwidth = copy_bandwidth(torch, device)
    context = counts["decode_context"] + counts["decode_steps"] / 2
    nbytes = step_bytes(model, counts["decode_seqs"], context)
    return {
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "decode_step_bytes": nbytes,
        "decode_floor_ms": nbytes / bandwidth * 1e3,
    }

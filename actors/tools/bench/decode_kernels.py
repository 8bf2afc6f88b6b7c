"""Where the forward's time goes: a profile of the paged decode step, its kernels grouped.

Torch's profiler records :data:`PROFILED_STEPS` decode steps of the Worker's forward (``bench
worker``'s paged decode, after one unrecorded step), run eagerly: a CUDA graph replays the very
same kernels, but not every torch version's profiler sees inside a replay. Each kernel is put
in a class by its name (:data:`CLASSES`: the GEMMs, the paged attention, the KV store, the
norms, the rotary, the gated activation, copies and the other elementwise kernels), with its
count and device time per step. On the CPU the same is done with the CPU's ops and their self
time: a dry run of the grouping, not a GPU's figure.

What it tells: the kernels' sum against the graph's step (the forward alone) is what launches
and gaps cost; each class against the step, where to work next; the GEMMs' time against the
weights' bytes over the copy bandwidth, how far the GEMMs run from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ringfence.actors.tools.bench.worker_sides import Sides

if TYPE_CHECKING:
    from ringfence.actors.model.decoder import Model

PROFILED_STEPS = 3
# (class, name fragments), first match wins; names lowercased. A GPU's GEMMs are cuBLAS's
# and CUTLASS's kernels (nvjet, xmma, cutlass, gemm); the CPU's are aten::mm and addmm.
CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("_paged_attention", "scaled_dot_product", "flash", "attention")),
    ("kv store", ("_store_kv", "index_put", "scatter")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "aten::mm", "aten::addmm", "aten::bmm")),
    ("norm", ("rms_norm", "rsqrt", "aten::pow", "aten::mean")),
    ("rotary", ("_rotate_rows", "aten::cat", "aten::neg")),
    ("activation", ("_silu_mul", "silu")),
    ("copy", ("memcpy", "memset", "copy", "aten::to", "aten::clone")),
    ("index", ("embedding", "index", "gather", "arange")),
    ("elementwise", ("elementwise", "aten::add", "aten::mul", "aten::div", "aten::sub")),
)


def kernel_class(name: str) -> str:
    """The class of a kernel (or a CPU op) named ``name`` (see :data:`CLASSES`), else other."""
    lowered = name.lower()
    for group, fragments in CLASSES:
        if any(fragment in lowered for fragment in fragments):
            return group
    return "other"


def group_kernels(rows: list[tuple[str, int, float]], steps: int) -> dict[str, Any]:
    """Rows of (name, count, microseconds) over ``steps`` steps as the report's figures: per
    step, the kernels' count and milliseconds in all and by class (largest first), and the
    five costliest kernels by name."""
    classes: dict[str, dict[str, float]] = {}
    for name, count, us in rows:
        figures = classes.setdefault(kernel_class(name), {"count": 0.0, "ms": 0.0})
        figures["count"] += count / steps
        figures["ms"] += us / 1e3 / steps
    ordered = dict(sorted(classes.items(), key=lambda item: -item[1]["ms"]))
    costliest = sorted(rows, key=lambda row: -row[2])[:5]
    return {
        "steps": steps,
        "kernels": sum(figures["count"] for figures in classes.values()),
        "kernel_ms": sum(figures["ms"] for figures in classes.values()),
        "classes": ordered,
        "costliest": [
            {"name": name[:120], "count": count / steps, "ms": us / 1e3 / steps}
            for name, count, us in costliest
        ],
    }


def profile_forward(model: Model, hf: Any, seqs: int, context: int) -> dict[str, Any]:
    """The grouped kernels of one eager decode step of the paged forward at ``seqs`` x
    ``context`` (the module docstring), with ``device`` saying whose time it is."""
    from torch.profiler import ProfilerActivity, profile

    counts = {
        "prefill_tokens": 1,
        "prefill_seqs": 1,
        "decode_seqs": seqs,
        "decode_context": context,
        "decode_steps": 1 + PROFILED_STEPS,
    }
    sides = Sides(model, hf, counts, path={"attention": "auto", "cuda_graphs": False})
    sides.paged_context()
    sides.paged_steps(1)  # unrecorded: the allocator, the kernels' first launches
    cuda = sides.device.type == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as recorded:
        sides.paged_steps(PROFILED_STEPS)
    rows = []
    for row in recorded.key_averages():
        if cuda:
            us = getattr(row, "self_device_time_total", None)
            if us is None:  # torch before 2.4
                us = row.self_cuda_time_total
        else:
            us = row.self_cpu_time_total
        if us > 0:
            rows.append((row.key, row.count, float(us)))
    return group_kernels(rows, PROFILED_STEPS) | {"device": "cuda" if cuda else "cpu"}

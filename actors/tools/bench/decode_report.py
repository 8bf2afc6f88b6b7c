"""The table ``ringfence bench decode`` prints and the PNG it draws (``--plot``).

The PNG has two panels over the batch sizes: the launched step stacked by its parts
(forward, sampling, engine, idle) beside the forward alone, transformers and the roofline's
floor, in milliseconds per step on a log scale; and each side's fraction of the roofline.
matplotlib (the ``bench`` extra) is imported only when a plot is asked for, and drawn on
its Agg canvas, never through ``pyplot`` (see ``plot.py``).
"""

from __future__ import annotations

import os
from typing import Any

from ringfence.actors.tools.bench.plot import INSTALL_HINT

PARTS = ("forward", "sampling", "engine", "idle")
COLORS = {"forward": "#4c72b0", "sampling": "#dd8452", "engine": "#55a868", "idle": "#c7c7c7"}


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def print_report(report: dict[str, Any]) -> None:
    """The figures of ``report`` as a few lines and one table row per batch size."""
    model, counts = report["model"], report["counts"]
    named = model["checkpoint"] or f"preset {model['preset']}"
    print(
        f"torch {report['torch']}, transformers {report['transformers']}, on {report['device']} "
        f"({report['threads']} thread(s)); {named} ({model['parameters']:,} parameters), "
        f"{model['dtype']}; {counts['prompt_tokens']} prompt tokens, {counts['output_tokens']} "
        f"output tokens; launches at log level {report['log_level']}"
    )
    print(f"copy bandwidth {report['copy_bandwidth_gb_s']:.1f} GB/s (read + write)")
    print(
        f"{'N':>4} {'tok/s':>9} {'TTFT50':>8} {'TPOT50':>8} {'TPOT90':>8} | {'step':>7} "
        f"{'fwd':>7} {'sample':>7} {'engine':>7} {'idle':>7} {'busy':>5} {'cycle':>5} "
        f"{'turn':>6} | "
        f"{'fwd-only':>8} "
        f"{'hf':>7} {'floor':>7} | roofline: launch fwd hf"
    )
    for point in report["points"]:
        launch, step = point["launch"], point["launch"]["step"]
        parts = step["parts_ms"]
        busy, cycle = step["device_busy"], step["worker_cycle"]["over_exec"]
        turn = step["engine_turn"]["turn_ms"]
        roof, hf = point["roofline"], point["transformers"]
        print(
            f"{point['seqs']:>4} {launch['output_tokens_per_s']:>9.1f} "
            f"{_ms(launch['ttft_p50_ms']):>8} {_ms(launch['tpot_p50_ms']):>8} "
            f"{_ms(launch['tpot_p90_ms']):>8} | {step['step_ms']:>7.2f} "
            + " ".join(f"{_ms(parts[p]):>7}" for p in PARTS)
            + f" {'n/a' if busy is None else f'{busy:.0%}':>5}"
            + f" {'n/a' if cycle is None else f'{cycle:.2f}':>5} {_ms(turn):>6} | "
            f"{point['forward']['step_ms']:>8.2f} {_ms(hf and hf['step_ms']):>7} "
            f"{roof['floor_ms']['forward']:>7.3f} | {roof['launch']:.3f} {roof['forward']:.3f} "
            f"{_ratio(roof['transformers'])}"
        )
    hows = sorted({p["transformers"]["how"] for p in report["points"] if p["transformers"]})
    print(
        "milliseconds per decode step; TTFT/TPOT in ms; busy: the forward's share of the "
        "steady decode; cycle: the Worker's step-to-step time over its execution (1.0: it "
        "never waits); turn: the engine's, from a result to the next step issued (two in "
        "flight hide it while it is under fwd + sample); hf: transformers on a static "
        f"cache, {', '.join(hows) or 'not timed'}; roofline: "
        "floor / step (1.0 is the hardware's pace)"
    )
    if report["log_level"] == "info":
        print("(at log level info the engine's lines are absent: engine and idle are one figure)")
    print_beside(report["points"])
    print_kernels(report["points"])


def print_beside(points: list[dict[str, Any]]) -> None:
    """A line for each ``--vs`` launch: its figures against the first launch's."""
    for point in points:
        for extra, launch in point.get("vs", {}).items():
            step, base = launch["step"], point["launch"]["step"]
            busy, ahead = step["device_busy"], step.get("launched_ahead")
            print(
                f"{point['seqs']:>4} with {extra}: {launch['output_tokens_per_s']:.1f} tok/s, "
                f"TPOT50 {_ms(launch['tpot_p50_ms'])}, step {step['step_ms']:.2f} ms "
                f"({step['step_ms'] / base['step_ms']:.2f}x the first), busy "
                f"{'n/a' if busy is None else f'{busy:.0%}'}, launched ahead "
                f"{'n/a' if ahead is None else f'{ahead:.0%}'}"
            )


def print_kernels(points: list[dict[str, Any]]) -> None:
    """A line a batch size: the forward's kernels a step by class (``decode_kernels.py``)."""
    profiled = [point for point in points if point.get("kernels")]
    if not profiled:
        return
    device = profiled[0]["kernels"]["device"]
    what = "kernels (device time)" if device == "cuda" else "CPU ops (self time)"
    print(f"where the forward's time goes, eager, per decode step: {what}, ms (count)")
    for point in profiled:
        kernels = point["kernels"]
        classes = ", ".join(
            f"{name} {figures['ms']:.3f} ({figures['count']:.0f})"
            for name, figures in kernels["classes"].items()
        )
        gemm = kernels["classes"].get("gemm", {}).get("ms")
        floor = kernels["weights_floor_ms"]
        against = f"; gemm / weights' floor {gemm / floor:.1f}x" if gemm else ""
        print(
            f"{point['seqs']:>4}: {kernels['kernels']:.0f} in {kernels['kernel_ms']:.2f} ms "
            f"(the forward alone {point['forward']['step_ms']:.2f}){against}: {classes}"
        )


def write_plot(path: str | os.PathLike[str], report: dict[str, Any]) -> None:
    """Write the PNG described in the module docstring to ``path``; RuntimeError saying how
    to install matplotlib when it is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError(f"plotting needs matplotlib: {INSTALL_HINT}") from e

    points = report["points"]
    labels = [str(p["seqs"]) for p in points]
    xs = list(range(len(points)))
    fig = Figure(figsize=(9.0, 7.0), layout="constrained")
    FigureCanvasAgg(fig)
    steps, roofs = fig.subplots(2, 1)
    bottom = [0.0] * len(points)
    width = 0.2
    for part in PARTS:
        heights = [p["launch"]["step"]["parts_ms"][part] or 0.0 for p in points]
        if part == "idle" and report["log_level"] == "info":
            heights = [p["launch"]["step"]["between_ms"] for p in points]
        left = [x - 1.5 * width for x in xs]
        steps.bar(left, heights, width, bottom=bottom, label=f"launch: {part}", color=COLORS[part])
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    sides = (("forward alone", "forward", "#8172b3"), ("transformers", "transformers", "#937860"))
    for offset, (name, key, color) in enumerate(sides):  # an N transformers skipped: no bar
        heights = [p[key]["step_ms"] if p[key] else 0.0 for p in points]
        steps.bar([x - (0.5 - offset) * width for x in xs], heights, width, label=name,
                  color=color)  # fmt: skip
    floor = [p["roofline"]["floor_ms"]["forward"] for p in points]
    steps.bar([x + 1.5 * width for x in xs], floor, width, label="roofline floor", color="black")
    steps.set_yscale("log")
    steps.set_ylabel("ms per decode step")
    steps.set_xticks(xs, labels)
    steps.legend(fontsize="small", ncols=2)
    model = report["model"]
    steps.set_title(
        f"{report['device']}: {model['checkpoint'] or model['preset']}, {model['dtype']}"
    )
    for name, key in (("launch", "launch"), ("forward alone", "forward"), ("hf", "transformers")):
        ys = [p["roofline"][key] for p in points]
        shown = [(x, y) for x, y in zip(xs, ys, strict=True) if y is not None]
        roofs.plot([x for x, _ in shown], [y for _, y in shown], marker="o", label=name)
    roofs.set_yscale("log")
    roofs.set_ylabel("fraction of the roofline")
    roofs.set_xlabel("sequences decoding together (N)")
    roofs.set_xticks(xs, labels)
    roofs.legend(fontsize="small")
    fig.savefig(os.fspath(path), format="png", dpi=100)

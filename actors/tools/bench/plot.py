"""A PNG bar chart of a benchmark's named ratios, each next to its target.

matplotlib is an optional dependency (the ``bench`` and ``test`` extras) and is imported
only inside the writers, so ``ringfence --help`` and the benchmarks' JSON output
never need it. The figure is drawn on matplotlib's Agg canvas directly, never through
``pyplot``: no global figure state, no GUI backend, safe to call from any thread.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

INSTALL_HINT = "pip install 'ringfence[bench]'"
_BAR = "#4c72b0"
_TARGET = "#c44e52"


Ratios = Sequence[tuple[str, float, float | None]]  # (label, value, target or None)


def write_ratio_plot(path: str | os.PathLike[str], ratios: Ratios, *, title: str) -> None:
    """Write a horizontal bar chart of ``(label, value, target or None)`` to ``path`` (PNG).

    Bars run top to bottom in the order given; a dashed line marks 1.0, a red diamond each
    target, and each bar is labelled with its value (``n/a`` for a value that is not a
    finite number, drawn as no bar). ValueError on no ratios; RuntimeError saying how to
    install matplotlib when it is missing.
    """
    write_ratio_panels(path, [(title, ratios)], title=None)


def write_ratio_panels(
    path: str | os.PathLike[str], panels: Sequence[tuple[str, Ratios]], *, title: str | None
) -> None:
    """:func:`write_ratio_plot` with one panel per ``(panel title, ratios)``, stacked, each
    scaled to its own ratios; panels with no ratios are left out (ValueError if none has
    any)."""
    panels = [(name, ratios) for name, ratios in panels if ratios]
    if not panels:
        raise ValueError("write_ratio_plot: no ratios to plot")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise RuntimeError(f"plotting needs matplotlib: {INSTALL_HINT}") from e

    heights = [0.6 + 0.45 * len(ratios) for _, ratios in panels]
    fig = Figure(figsize=(7.0, 0.6 + sum(heights)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": heights})
    for ax, (name, ratios) in zip(axes[:, 0], panels, strict=True):
        finite = [v for _, v, _ in ratios if math.isfinite(v)]
        targets = [t for _, _, t in ratios if t is not None and math.isfinite(t)]
        _draw(ax, ratios, max([1.0, *finite, *targets]) * 1.2)
        ax.set_title(name, fontsize="medium")
    axes[-1, 0].set_xlabel("ratio")
    if title is not None:
        fig.suptitle(title)
    fig.savefig(os.fspath(path), format="png", dpi=100)


def _draw(ax: Any, ratios: Ratios, right: float) -> None:
    """One panel's bars, targets and labels on ``ax`` (x from 0 to ``right``)."""
    values = [value if math.isfinite(value) else 0.0 for _, value, _ in ratios]
    targets = [(i, t) for i, (_, _, t) in enumerate(ratios) if t is not None and math.isfinite(t)]
    rows = range(len(ratios))
    ax.barh(rows, values, color=_BAR, height=0.6)
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    if targets:
        ax.scatter(
            [t for _, t in targets],
            [i for i, _ in targets],
            marker="D",
            color=_TARGET,
            zorder=3,
            label="target",
        )
        ax.legend(loc="best", fontsize="small")
    for row, (_, value, _) in zip(rows, ratios, strict=True):
        text = f"{value:.2f}x" if math.isfinite(value) else "n/a"
        x = value if math.isfinite(value) else 0.0
        ax.text(x + right * 0.01, row, text, va="center", fontsize="small")
    ax.set_yticks(list(rows), [label for label, _, _ in ratios])
    ax.invert_yaxis()  # the first ratio on top
    ax.set_xlim(0, right)

"""How ``ringfence bench e2e`` shows its report: the printed tables and the PNG's panels."""

from __future__ import annotations

import os
from typing import Any

from ringfence.actors.tools.bench.e2e_pairs import DTYPE

LATENCY = ("ttft_p50_s", "ttft_p99_s", "tpot_p99_s")  # the ordering pairs' latency figures


def fmt(value: float | None, spec: str) -> str:
    """``value`` formatted by ``spec``, or "n/a" when unknown."""
    return "n/a" if value is None else format(value, spec)


def print_report(report: dict[str, Any]) -> None:
    """The rows as a table, then the ordering pairs' latency, what was skipped, the wall time."""
    print(
        f"torch {report['torch']}, {report['cpus']} CPU(s), OMP_NUM_THREADS={report['threads']}; "
        f"preset {report['preset']} ({DTYPE}), {report['counts']['requests']} requests a "
        f"workload, all at t=0; median of {report['counts']['rounds']} round(s)"
    )
    width = max(len(row["name"]) for row in report["rows"]) + 1
    columns = f"{'unit':>11}{'A':>10}{'B':>10}{'ratio':>8}{'target':>8}  result  tokens"
    print(f"  {'pair':<{width}}{columns}")
    for row in report["rows"]:
        target = row["target"]
        verdict = "-" if target is None else "pass" if row["meets_target"] else "FAIL"
        match = f"{row['tokens_match']:.0%}" if "tokens_match" in row else ""
        print(
            f"  {row['name']:<{width}}{row['unit']:>11}{fmt(row['a'], '10.3f')}"
            f"{fmt(row['b'], '10.3f')}{fmt(row['ratio'], '7.3f')}x"
            f"{fmt(target, '7.2f') if target is not None else '':>8}  {verdict:<6}  {match}"
        )
    print(
        "  (A/B: fence/sync, fence/lock, block/poll, tiers on/off, actor pipeline/local runner; "
        "TTFT and CPU ratios are B / A, above 1 = A better; tokens: requests with equal outputs)"
    )
    latency = [row for row in report["rows"] if "latency" in row]
    if latency:
        print(f"\n  {'latency of the ordering pairs, A / B':<{width}}", end="")
        print(f"{'TTFT p50 ms':>18}{'TTFT p99 ms':>18}{'TPOT p99 ms':>18}")
        for row in latency:
            cells = [
                " / ".join(fmt(None if v is None else v * 1e3, ".0f") for v in row["latency"][key])
                for key in LATENCY
            ]
            print(f"  {row['name']:<{width}}" + "".join(f"{c:>18}" for c in cells))
    for line in report.get("skipped", []):
        print(f"  skipped: {line}")
    print(f"wall time {report['wall_s']:.1f} s")


FAMILIES = (
    "ordering: fence / sync, fence / legacy lock",
    "waiting: doorbell / 1 ms poll",
    "tiers on / off",
    "control plane: actor pipeline / plain loop",
)


def family(name: str) -> str:
    """The plot panel of row ``name``."""
    if "fence/" in name:
        return FAMILIES[0]
    if name.startswith("block/poll"):
        return FAMILIES[1]
    return FAMILIES[2] if name.startswith("tiers") else FAMILIES[3]


def write_plot(report: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """The rows' ratios as a PNG, one panel per family (see :func:`family`)."""
    from ringfence.actors.tools.bench.plot import write_ratio_panels

    panels: dict[str, list[tuple[str, float, float | None]]] = {f: [] for f in FAMILIES}
    for r in report["rows"]:
        ratio = r["ratio"] if r["ratio"] is not None else float("nan")
        panels[family(r["name"])].append((r["name"], ratio, r["target"]))
    counts = report["counts"]
    title = f"ringfence bench e2e ({report['preset']}, {counts['requests']} requests)"
    write_ratio_panels(path, list(panels.items()), title=title)

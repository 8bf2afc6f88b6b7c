"""The figures of ``ringfence bench router-latency``: per cell, each side's latency
percentiles, the router's added latency (router minus direct, percentile by percentile),
the router's CPU time per request, the target's verdict; and the table. Pure and
clock-free.

The target is the issue's: the router on its own, one request at a time, so it is judged
on the rows of concurrency 1 only. At a higher concurrency the added latency includes the
requests queued in the router behind each other (its CPU time times the queue), which the
rows show but the target does not speak of.

The added latency at a percentile is the difference of the two sides' percentiles, not a
percentile of per-request differences: the two sides send the same requests, but not at
the same moments, so no request of one side is paired with one of the other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from ringfence.actors.engine.percentiles import percentile
from ringfence.actors.tools.bench.serving.latency_load import SIDES, Sample

QUANTILES: Final = (50, 90, 99)
TARGET_P99_ADDED_S: Final = 0.002  # issue 36: the router adds under 2 ms at p99
ERRORS_KEPT: Final = 5  # distinct errors a side's figures quote


def side_figures(samples: Sequence[Sample]) -> dict[str, Any]:
    """Requests, failures (and the first distinct errors), and p50/p90/p99 of the
    latency of those that succeeded (None without any)."""
    ok = [s.latency_s for s in samples if not s.error]
    errors = list(dict.fromkeys(s.error for s in samples if s.error))
    figures: dict[str, Any] = {"requests": len(samples), "failed": len(samples) - len(ok)}
    for q in QUANTILES:
        figures[f"p{q}_s"] = percentile(ok, q) if ok else None
    figures["errors"] = errors[:ERRORS_KEPT]
    return figures


def row(
    *, policy: str, concurrency: int, prompt: str, stream: bool,
    sides: Mapping[str, Sequence[Sample]], routed_total_s: Sequence[float] = (),
    router_cpu_s: float | None = None,
) -> dict[str, Any]:  # fmt: skip
    """One cell of the report: both sides' figures, the added latency per percentile, and
    whether the added p99 is under the target (None when a side has no figures, or at a
    concurrency above 1). ``routed_total_s``: the router's own ``total_s`` of the cell's
    measured requests (its log); ``router_cpu_s``: the router process's CPU seconds per
    request it routed in the cell; both tell where the added time goes."""
    figures = {side: side_figures(sides[side]) for side in SIDES}
    added: dict[str, float | None] = {}
    for q in QUANTILES:
        mine, theirs = figures["router"][f"p{q}_s"], figures["direct"][f"p{q}_s"]
        added[f"p{q}_s"] = None if mine is None or theirs is None else mine - theirs
    p99 = added["p99_s"]
    own = {f"p{q}_s": percentile(routed_total_s, q) for q in QUANTILES} if routed_total_s else {}
    return {
        "policy": policy,
        "concurrency": concurrency,
        "prompt": prompt,
        "stream": stream,
        **figures,
        "added": added,
        "router_log_total": own,
        "router_cpu_per_request_s": router_cpu_s,
        "target_met": None if p99 is None or concurrency != 1 else p99 < TARGET_P99_ADDED_S,
    }


def verdict(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The target over the rows of concurrency 1 (see the module docstring): met when every
    one of them is; informational, never an exit status."""
    single = [r for r in rows if r["concurrency"] == 1]
    return {
        "p99_added_under_s": TARGET_P99_ADDED_S,
        "met": bool(single) and all(r["target_met"] for r in single),
        "worst_p99_added_s": max(
            (p for r in single if (p := r["added"]["p99_s"]) is not None), default=None
        ),
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.2f}"


def table(result: Mapping[str, Any]) -> str:
    """The rows as text (milliseconds), then the verdict."""
    head = (
        f"{'policy':<13}{'conc':>4} {'prompt':<7}{'answer':<7}"
        f"{'direct p50':>11}{'p90':>7}{'p99':>7}{'router p50':>11}{'p90':>7}{'p99':>7}"
        f"{'added p50':>10}{'p90':>7}{'p99':>7}{'cpu/req':>8}  target"
    )
    lines = [head]
    for r in result["rows"]:
        d, t, a = r["direct"], r["router"], r["added"]
        failed = d["failed"] + t["failed"]
        mark = {True: "PASS", False: "FAIL", None: "-"}[r["target_met"]]
        lines.append(
            f"{r['policy']:<13}{r['concurrency']:>4} {r['prompt']:<7}"
            f"{'sse' if r['stream'] else 'json':<7}"
            f"{_ms(d['p50_s']):>11}{_ms(d['p90_s']):>7}{_ms(d['p99_s']):>7}"
            f"{_ms(t['p50_s']):>11}{_ms(t['p90_s']):>7}{_ms(t['p99_s']):>7}"
            f"{_ms(a['p50_s']):>10}{_ms(a['p90_s']):>7}{_ms(a['p99_s']):>7}"
            f"{_ms(r['router_cpu_per_request_s']):>8}  {mark}"
            + (f"  ({failed} failed)" if failed else "")
        )
    v = result["target"]
    lines.append(
        f"  target: the router adds under {v['p99_added_under_s'] * 1000:g} ms at p99, one "
        f"request at a time: {'PASS' if v['met'] else 'FAIL'} (worst added p99 at "
        f"concurrency 1: {_ms(v['worst_p99_added_s'])} ms; informational)"
    )
    lines.append(
        f"  (milliseconds; {result['requests']} requests a side and cell after "
        f"{result['warmup']} of warm-up; cpu/req: the router process's CPU per request it "
        f"routed; {result['cpus']} CPUs)"
    )
    return "\n".join(lines)

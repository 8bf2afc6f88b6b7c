"""What ``ringfence bench serve`` reports: a launch's figures in the serve side's shape,
one row per (workload, rate) with the serve/launch ratios, the table, the plot, and the
failures that make the run's exit status 1.

Standard library and orjson only (matplotlib inside :func:`plot`, through
:mod:`ringfence.actors.tools.bench.plot`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ringfence.actors.engine.percentiles import stats
from ringfence.actors.tools.bench.serving.security import table_lines as security_lines
from ringfence.actors.tools.bench.serving.stats import rate_label

NO_STATS: dict[str, float | None] = {"p50": None, "p99": None, "mean": None}


def launched(summary: Mapping[str, Any], outputs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A launch's ``summary.json`` and ``outputs.jsonl`` as the serve side's figures (see
    :func:`ringfence.actors.tools.bench.serving.stats.summarize`): no ITL (a launch records no
    per-token times), TPOT recomputed over the requests' ``tpot_s``."""
    requests, throughput = summary["requests"], summary["throughput"]
    return {
        "requests": {
            "total": requests["total"],
            "finished": requests["finished"],
            "failed": requests["total"] - requests["finished"],
        },
        "output_tokens": summary["tokens"]["output"],
        "duration_s": summary["duration_s"],
        "throughput": {
            "requests_per_s": throughput["requests_per_s"],
            "output_tokens_per_s": throughput["output_tokens_per_s"],
        },
        "ttft_s": dict(summary["ttft_s"]),
        "tpot_s": stats([t for line in outputs if (t := line.get("tpot_s")) is not None]),
        "itl_s": dict(NO_STATS),
        "errors": sorted({str(line["error"]) for line in outputs if line.get("error")}),
        "cached_tokens": summary.get("cached_tokens"),
        "tokens": {str(line["id"]): list(line["token_ids"]) for line in outputs},
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def row(
    workload: str, rate: float, served: Mapping[str, Any], launch: Mapping[str, Any]
) -> dict[str, Any]:
    """One (workload, rate) pair: both sides' figures (without their tokens), the
    serve/launch ratios of TTFT p50 and output-token throughput, and the share of
    requests whose output tokens are equal on both sides."""
    a, b = served["tokens"], launch["tokens"]
    ids = set(a) | set(b)
    match = sum(a.get(i) == b.get(i) for i in ids) / len(ids) if ids else None
    return {
        "workload": workload,
        "rate": rate_label(rate),
        "serve": {k: v for k, v in served.items() if k != "tokens"},
        "launch": {k: v for k, v in launch.items() if k != "tokens"},
        "ratios": {
            "ttft_p50": _ratio(served["ttft_s"]["p50"], launch["ttft_s"]["p50"]),
            "output_tokens_per_s": _ratio(
                served["throughput"]["output_tokens_per_s"],
                launch["throughput"]["output_tokens_per_s"],
            ),
        },
        "tokens_match": match,
    }


def _ms(stat: Mapping[str, Any], q: str) -> str:
    value = stat.get(q)
    return "-" if value is None else f"{value * 1e3:.0f}"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pair(stat: Mapping[str, Any]) -> str:
    return f"{_ms(stat, 'p50')}/{_ms(stat, 'p99')}"


def _side_line(workload: str, rate: str, side: str, f: Mapping[str, Any]) -> str:
    done = f"{f['requests']['finished']}/{f['requests']['total']}"
    return (
        f"{workload:<8}{rate:>5}  {side:<7}{done:>7}{_pair(f['ttft_s']):>14}"
        f"{_pair(f['tpot_s']):>12}{_pair(f['itl_s']):>12}"
        f"{_num(f['throughput']['requests_per_s'], '.2f'):>8}"
        f"{_num(f['throughput']['output_tokens_per_s'], '.1f'):>9}"
    )


def _cpu(figures: Mapping[str, Any]) -> str:
    per_token = figures.get("frontend_cpu_s_per_token")
    return (
        f"{_num(figures.get('frontend_cpu_s_per_s'), '.3f')}, "
        f"{_num(None if per_token is None else per_token * 1e3, '.3f')}"
    )


def table(result: Mapping[str, Any]) -> str:
    """The report for the terminal: each pair's two sides, their ratios, then the burst."""
    lines = [
        f"{result['cpus']} CPU(s); {', '.join(result['settings'])}; {result['requests']} "
        f"requests a workload, Poisson arrivals (seed {result['seed']})",
        f"{'workload':<8}{'rate':>5}  {'side':<7}{'done':>7}{'TTFT p50/99':>14}"
        f"{'TPOT p50/99':>12}{'ITL p50/99':>12}{'req/s':>8}{'tok/s':>9}   (times in ms)",
    ]
    for r in result["rows"]:
        for side in ("serve", "launch"):
            lines.append(_side_line(r["workload"], r["rate"], side, r[side]))
    lines.append(
        f"{'workload':<8}{'rate':>5}  {'TTFT p50 serve/launch':>22}"
        f"{'throughput serve/launch':>25}{'same tokens':>13}{'front end CPU s/s, ms/tok':>27}"
    )
    for r in result["rows"]:
        ratios, match, serve = r["ratios"], r["tokens_match"], r["serve"]
        lines.append(
            f"{r['workload']:<8}{r['rate']:>5}  {_num(ratios['ttft_p50'], '.2f') + 'x':>22}"
            f"{_num(ratios['output_tokens_per_s'], '.2f') + 'x':>25}"
            f"{'-' if match is None else f'{match:.0%}':>13}{_cpu(serve):>27}"
        )
    lines += security_lines(result["rows"])
    b = result.get("burst")
    if b:
        per_token = b["frontend_cpu_s_per_token"]
        lines.append(
            f"front end at {b['streams']} concurrent streams: "
            f"{_num(b['frontend_cpu_s_per_s'], '.3f')} CPU s/s, "
            f"{_num(None if per_token is None else per_token * 1e3, '.3f')} CPU ms per "
            f"output token ({b['output_tokens']} tokens in {b['wall_s']:.1f} s, "
            f"{b['requests']['finished']}/{b['requests']['total']} streams finished)"
        )
    lines.append(f"wall time {result['wall_s']:.1f} s")
    return "\n".join(lines)


def plot(path: Path, result: Mapping[str, Any]) -> None:
    """The serve/launch ratios as a PNG bar chart (n/a where a ratio is unknown)."""
    from ringfence.actors.tools.bench.plot import write_ratio_plot

    bars: list[tuple[str, float, float | None]] = []
    for r in result["rows"]:
        name = f"{r['workload']} @ {r['rate']}/s"
        for key, label in (("ttft_p50", "TTFT p50"), ("output_tokens_per_s", "throughput")):
            value = r["ratios"][key]
            bars.append((f"{name} {label}", float("nan") if value is None else value, None))
    write_ratio_plot(path, bars, title="ringfence bench serve: serve / launch")


def failures(result: Mapping[str, Any]) -> list[str]:
    """What went wrong in a finished run: failed requests, names a server left behind."""
    found = []
    sides = [
        (f"{r['workload']} @ {r['rate']}/s {side}", r[side])
        for r in result["rows"]
        for side in ("serve", "launch")
    ]
    sides += [
        (f"{r['workload']} @ {r['rate']}/s serve {mode}", side["figures"])
        for r in result["rows"]
        for mode, side in r.get("security", {}).items()
    ]
    if result.get("burst"):
        sides.append(("burst", result["burst"]))
    for name, figures in sides:
        if figures["requests"]["failed"]:
            found.append(
                f"{name}: {figures['requests']['failed']} request(s) failed: {figures['errors']}"
            )
        if figures.get("leaked_names"):
            found.append(f"{name}: the server left {figures['leaked_names']} in /dev/shm")
    return found

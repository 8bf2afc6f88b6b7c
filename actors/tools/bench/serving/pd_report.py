"""What ``ringfence bench pd`` reports: figures per side and class of request, medians over
rounds, the pd/both ratios, the hand-over's cost, the table, the plot, and the failures
that make the run's exit status 1.

Standard library and orjson only (matplotlib inside :func:`plot`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ringfence.actors.tools.bench.e2e_runs import median, ratio_of
from ringfence.actors.tools.bench.serving.client import LoadRequest
from ringfence.actors.tools.bench.serving.stats import Timeline, busy_period, summarize

SIDES = ("both", "pd")
ALL = "all"
# The flat figures of one side and class (seconds, or tokens per second).
FIGURES = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tpot_p50", "tpot_p99", "tokens_per_s")
RATIOS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "tokens_per_s")
# The hand-over's figures the table shows: (label, path into one round's figures, unit).
HANDOVER = (
    ("write", ("write", "us_per_block"), "us/block"),
    ("visible", ("visible", "ms_per_block"), "ms/block"),
    ("visible wait p50", ("visible", "wait_ms", "p50"), "ms/request"),
    ("prefetched", ("prefetched", "us_per_block"), "us/block"),
    ("prefill stage p50", ("router", "prefill_s", "p50"), "s/request"),
)


def class_of(request_id: str) -> str:
    """A request's class: its id's first word (``stream-3``: ``stream``)."""
    return request_id.split("-", 1)[0]


def side_figures(timelines: Sequence[Timeline], start: float) -> dict[str, dict[str, Any]]:
    """Per class and over all: the flat FIGURES, requests finished and total, errors.
    Throughput counts each class's tokens over the whole side's busy period."""
    duration = busy_period(timelines, start_s=start)
    classes = sorted({class_of(t.id) for t in timelines})
    out = {}
    for name in [*classes, ALL]:
        chosen = [t for t in timelines if name == ALL or class_of(t.id) == name]
        s = summarize(chosen, duration_s=duration)
        out[name] = {
            "ttft_p50": s["ttft_s"]["p50"], "ttft_p99": s["ttft_s"]["p99"],
            "itl_p50": s["itl_s"]["p50"], "itl_p99": s["itl_s"]["p99"],
            "tpot_p50": s["tpot_s"]["p50"], "tpot_p99": s["tpot_s"]["p99"],
            "tokens_per_s": s["throughput"]["output_tokens_per_s"],
            "finished": s["requests"]["finished"], "total": s["requests"]["total"],
            "errors": s["errors"],
        }  # fmt: skip
    return out


def from_tier(timelines: Sequence[Timeline]) -> float | None:
    """The share of prompt tokens served from the storage tier (the usage chunks')."""
    prompt = stored = 0
    for t in timelines:
        if t.error or not t.usage:
            continue
        prompt += int(t.usage.get("prompt_tokens") or 0)
        cached = (t.usage.get("ringfence") or {}).get("cached_tokens") or {}
        stored += int(cached.get("storage") or 0)
    return stored / prompt if prompt else None


def _tokens_match(a: Sequence[Timeline], b: Sequence[Timeline]) -> float | None:
    left = {t.id: t.token_ids for t in a if not t.error}
    right = {t.id: t.token_ids for t in b if not t.error}
    ids = set(left) | set(right)
    return sum(left.get(i) == right.get(i) for i in ids) / len(ids) if ids else None


def _at(figures: Mapping[str, Any], path: Sequence[str]) -> Any:
    for key in path:
        figures = figures.get(key) or {}
    return figures if isinstance(figures, int | float) else None


def figures(
    requests: Sequence[LoadRequest], rounds: Sequence[Mapping[str, Mapping[str, Any]]]
) -> dict[str, Any]:
    """Each round's figures (sides by class, tokens matched, tier share, hand-over), then
    ``rows``: per class each side's medians over rounds and their pd/both ratios."""
    per_round = []
    for found in rounds:
        sides = {name: side_figures(found[name]["timelines"], found[name]["start"])
                 for name in SIDES}  # fmt: skip
        per_round.append({
            "sides": sides,
            "tokens_match": _tokens_match(found["both"]["timelines"], found["pd"]["timelines"]),
            "from_tier": from_tier(found["pd"]["timelines"]),
            "leaked_names": {name: found[name]["leaked_names"] for name in SIDES},
            "handover": found["pd"]["handover"],
        })  # fmt: skip
    rows = []
    for name in per_round[0]["sides"]["both"]:
        medians = {
            side: {k: median([r["sides"][side][name][k] for r in per_round]) for k in FIGURES}
            for side in SIDES
        }
        rows.append({
            "class": name,
            "requests": sum(class_of(r.id) == name or name == ALL for r in requests),
            **medians,
            "ratios": {k: ratio_of(medians["pd"][k], medians["both"][k]) for k in RATIOS},
        })  # fmt: skip
    return {
        "rounds": per_round,
        "rows": rows,
        "tokens_match": median([r["tokens_match"] for r in per_round]),
        "from_tier": median([r["from_tier"] for r in per_round]),
        "handover": {
            label: median([_at(r["handover"], path) for r in per_round])
            for label, path, _ in HANDOVER
        },
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.0f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pair(side: Mapping[str, Any], what: str) -> str:
    return f"{_ms(side[f'{what}_p50'])}/{_ms(side[f'{what}_p99'])}"


def table(result: Mapping[str, Any]) -> str:
    """The report for the terminal: each class's two sides, the ratios, the hand-over."""
    lines = [
        f"{result['cpus']} CPU(s); {', '.join(result['settings'])}; {result['workload']}, "
        f"{result['requests']} requests; medians of {len(result['rounds'])} round(s); "
        f"pd Workers {result['pd_worker_threads']} thread(s) each",
        f"{'class':<8}{'reqs':>5}  {'side':<5}{'TTFT p50/99':>14}{'ITL p50/99':>12}"
        f"{'TPOT p50/99':>13}{'tok/s':>8}   (times in ms)",
    ]
    for row in result["rows"]:
        for side in SIDES:
            f = row[side]
            lines.append(
                f"{row['class']:<8}{row['requests']:>5}  {side:<5}{_pair(f, 'ttft'):>14}"
                f"{_pair(f, 'itl'):>12}{_pair(f, 'tpot'):>13}{_num(f['tokens_per_s'], '.1f'):>8}"
            )
    lines.append(
        f"{'pd/both':<8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'tok/s':>8}"
    )
    for row in result["rows"]:
        r = row["ratios"]
        lines.append(
            f"{row['class']:<8}{_x(r['ttft_p50']):>10}{_x(r['ttft_p99']):>10}"
            f"{_x(r['itl_p50']):>9}{_x(r['itl_p99']):>9}{_x(r['tokens_per_s']):>8}"
        )
    match, tier = result["tokens_match"], result["from_tier"]
    lines.append(
        f"same tokens on both sides: {_num(None if match is None else match * 100, '.0f')}%; "
        f"prompt tokens the decode instance took from the tier: "
        f"{_num(None if tier is None else tier * 100, '.0f')}%"
    )
    units = {label: unit for label, _, unit in HANDOVER}
    costs = ", ".join(
        f"{label} {_num(value, '.3g')} {units[label]}"
        for label, value in result["handover"].items()
    )
    lines.append(f"hand-over: {costs}")
    last = result["rounds"][-1]["handover"]
    lines.append(
        f"last round: {last['write']['blocks']} blocks written in {last['write']['ops']} ops, "
        f"{last['prefetched']['blocks']} prefetched ({last['prefetched']['missing']} missing); "
        f"router: {last['router']['outcomes']}, fallbacks {last['router']['fallbacks'] or 0}, "
        f"reserve retries {last['router']['reserve_retries']}, "
        f"claimed again {last['router']['reclaimed']}"
    )
    lines.append(f"wall time {result['wall_s']:.1f} s")
    return "\n".join(lines)


def plot(path: Path, result: Mapping[str, Any]) -> None:
    """The pd/both ratios per class as a PNG bar chart (below 1: pd is faster)."""
    from ringfence.actors.tools.bench.plot import write_ratio_plot

    bars: list[tuple[str, float, float | None]] = []
    for row in result["rows"]:
        for key in ("itl_p99", "itl_p50", "ttft_p50", "ttft_p99"):
            value = row["ratios"][key]
            bars.append((f"{row['class']} {key}", float("nan") if value is None else value, None))
    write_ratio_plot(path, bars, title="ringfence bench pd: pd / both (below 1: pd faster)")


def failures(result: Mapping[str, Any]) -> list[str]:
    """Failed requests and names a server left behind, by round and side."""
    found = []
    for index, r in enumerate(result["rounds"]):
        for side in SIDES:
            everything = r["sides"][side][ALL]
            failed = everything["total"] - everything["finished"]
            if failed:
                found.append(
                    f"round {index} {side}: {failed} request(s) failed: {everything['errors']}"
                )
            if r["leaked_names"][side]:
                found.append(f"round {index} {side}: left {r['leaked_names'][side]} in /dev/shm")
    return found

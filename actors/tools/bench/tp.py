"""``ringfence bench tp``: one workload at each tensor-parallel size, side by side.

Each side is a real ``ringfence launch`` (see :func:`e2e_runs.launched_run`) of the same
synthetic workload (its first ``--requests`` requests, all at t=0) on the same preset
(``float32``), differing only in ``parallel.tp_size``: one of the ``--tp`` sizes (default
1 and 2). The sides alternate, ``--rounds`` times (reversed every other round); figures
are medians over the rounds, the throughput ratio is each size's median over the first
size's. Every process gets ``OMP_NUM_THREADS=--threads``, so tp N uses N times the
threads of tp 1: on a machine with few cores tp 2 is not faster, and the report says so.

Per side, from ``summary.json``: output tokens per second over the busy period, TTFT and
TPOT p50. From the Workers' ``step.done`` lines (``worker-<rank>.jsonl``; the steps that
ran, status ``ok`` with pieces, every rank's line counted as one sample): all-reduce
milliseconds per step (mean: the sum of ``reduce_ns`` over the steps; and p50), the share
of ``exec_ns`` spent in all-reduces, and all-reduces per step. Output tokens are compared
request by request with the first size's (round 1): float32 sums taken in another order
can flip a near-tie, so the fraction that matches is reported, not asserted.

A failed launch (nonzero exit, timeout, no summary, an aborted request) or a run dir
without its Workers' logs is an error (exit status 1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ringfence.actors.tools.bench import e2e_runs, launcher
from ringfence.actors.tools.bench.e2e_pairs import DTYPE, Run, common_settings
from ringfence.actors.tools.bench.e2e_report import fmt
from ringfence.actors.tools.bench.launcher import RunError
from ringfence.actors.tools.bench.options import (
    add_counts,
    environment,
    resolve_counts,
    resolve_preset,
)

WORKLOADS = ("unique", "pressure")  # synthetic workloads that run all at t=0
NS_PER_MS = 1_000_000

# name: (default, quick default, help)
COUNTS: dict[str, tuple[int, int, str]] = {
    "rounds": (2, 1, "rounds of every size, sides alternating"),
    "requests": (8, 2, "requests of the workload"),
    "timeout": (600, 300, "seconds each launch may take"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument("--quick", action="store_true", help="tiny preset, a few requests (tests)")
    parser.add_argument("--preset", help="model preset (small; quick: tiny; tp 4: tiny-4kv)")
    add_counts(parser, COUNTS)
    parser.add_argument(
        "--tp", default="1,2", metavar="N,...", help="tensor-parallel sizes, the baseline first"
    )
    parser.add_argument("--workload", default="unique", choices=WORKLOADS, help="(unique)")
    parser.add_argument(
        "--threads", type=int, help="OMP_NUM_THREADS of every process (CPUs / 4, at least 1)"
    )


def parse_sizes(text: str) -> tuple[int, ...]:
    """``--tp``: distinct sizes >= 1, comma-separated; ValueError naming the bad value."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--tp: expected sizes like 1,2, got {text!r}") from None
    if any(n < 1 for n in sizes) or len(set(sizes)) != len(sizes):
        raise ValueError(f"--tp: sizes must be distinct and >= 1, got {text!r}")
    return sizes


@dataclass(frozen=True, slots=True)
class StepStats:
    """The Worker steps that ran, from their ``step.done`` lines (one sample per rank's line)."""

    steps: int  # step.done lines with status ok and pieces
    exec_ns: int  # their exec_ns, summed
    reduce_ns: int  # their reduce_ns, summed (none under tp 1)
    reduces: int  # their all-reduces, counted
    reduce_ms_p50: float | None  # median all-reduce milliseconds of a step

    @property
    def reduce_ms_mean(self) -> float | None:
        return self.reduce_ns / self.steps / NS_PER_MS if self.steps else None

    @property
    def reduce_share(self) -> float | None:
        """The share of the steps' execution time spent in all-reduces."""
        return self.reduce_ns / self.exec_ns if self.exec_ns else None

    @property
    def reduces_per_step(self) -> float | None:
        return self.reduces / self.steps if self.steps else None

    @property
    def exec_ms_mean(self) -> float | None:
        return self.exec_ns / self.steps / NS_PER_MS if self.steps else None

    def figures(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "exec_ms_mean": self.exec_ms_mean,
            "reduce_ms_mean": self.reduce_ms_mean,
            "reduce_ms_p50": self.reduce_ms_p50,
            "reduce_share": self.reduce_share,
            "reduces_per_step": self.reduces_per_step,
        }


def step_stats(lines: Iterable[dict[str, Any]]) -> StepStats:
    """The :class:`StepStats` of the log lines: steps that ran (other events are skipped)."""
    ran = [
        line
        for line in lines
        if line.get("event") == "step.done" and line.get("status") == "ok" and line["pieces"]
    ]
    reduce_ns = [line.get("reduce_ns") or 0 for line in ran]
    return StepStats(
        steps=len(ran),
        exec_ns=sum(line["exec_ns"] for line in ran),
        reduce_ns=sum(reduce_ns),
        reduces=sum(line.get("reduces") or 0 for line in ran),
        reduce_ms_p50=statistics.median(reduce_ns) / NS_PER_MS if ran else None,
    )


def read_worker_log(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    """The lines of ``worker-<rank>.jsonl`` (see :func:`launcher.read_log`)."""
    return launcher.read_log(run_dir, f"worker-{rank}")


@dataclass(frozen=True, slots=True)
class TpSide:
    """One launch at one tensor-parallel size."""

    tp: int  # parallel.tp_size
    side: e2e_runs.Side  # throughput, TTFT, tokens from the summary and outputs
    tpot_p50_s: float | None  # median time per output token after the first
    steps: StepStats  # every rank's steps together
    ranks: tuple[StepStats, ...]  # each rank's, by rank


def run_side(run: Run, tp: int, *, threads: int, timeout: float, folder: Path) -> TpSide:
    """Launch ``run`` at ``parallel.tp_size=tp`` and read its summary and Workers' logs."""
    sized = Run(run.workload, run.requests, (*run.settings, f"parallel.tp_size={tp}"))
    with e2e_runs.launched_run(sized, threads=threads, timeout=timeout, folder=folder) as (
        side,
        path,
    ):
        summary = orjson.loads((path / "summary.json").read_bytes())
        logs = [read_worker_log(path, rank) for rank in range(tp)]
    return TpSide(
        tp=tp,
        side=side,
        tpot_p50_s=summary["tpot_s"]["p50"],
        steps=step_stats(line for log in logs for line in log),
        ranks=tuple(step_stats(log) for log in logs),
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def rows(sides: dict[int, list[TpSide]]) -> list[dict[str, Any]]:
    """One row per size (in ``sides``' order, the baseline first): medians over the rounds,
    the throughput ratio to the baseline and the tokens matched with it (round 1)."""
    base = next(iter(sides.values()))
    base_tps = e2e_runs.median([s.side.output_tokens_per_s for s in base])
    found = []
    for tp, runs in sides.items():

        def med(figure: str, runs: Sequence[TpSide] = runs) -> float | None:
            return e2e_runs.median([s.steps.figures()[figure] for s in runs])

        tps = e2e_runs.median([s.side.output_tokens_per_s for s in runs])
        found.append(
            {
                "tp": tp,
                "output_tokens_per_s": tps,
                "ratio": e2e_runs.ratio_of(tps, base_tps),
                "ttft_p50_ms": _ms(e2e_runs.median([s.side.ttft_p50_s for s in runs])),
                "tpot_p50_ms": _ms(e2e_runs.median([s.tpot_p50_s for s in runs])),
                **{k: med(k) for k in runs[0].steps.figures() if k != "steps"},
                "tokens_match": e2e_runs.tokens_match(runs[0].side, base[0].side),
                "rounds": [
                    {
                        "output_tokens_per_s": s.side.output_tokens_per_s,
                        "duration_s": s.side.duration_s,
                        "wall_s": round(s.side.wall_s, 3),
                        **s.steps.figures(),
                        "ranks": [r.figures() for r in s.ranks],
                    }
                    for s in runs
                ],
            }
        )
    return found


def bench(
    preset: str,
    workload: str,
    sizes: Sequence[int],
    counts: dict[str, int],
    threads: int,
) -> dict[str, Any]:
    """Every size's launches, ``counts["rounds"]`` times alternating, and their rows."""
    settings = tuple(common_settings(preset, counts["requests"]))
    run = Run(workload, counts["requests"], settings)
    sides: dict[int, list[TpSide]] = {tp: [] for tp in sizes}
    with tempfile.TemporaryDirectory(prefix="rf-bench-tp-") as tmp:
        for round_no in range(counts["rounds"]):
            for tp in sizes if round_no % 2 == 0 else sizes[::-1]:
                side = run_side(
                    run, tp, threads=threads, timeout=counts["timeout"], folder=Path(tmp)
                )
                sides[tp].append(side)
    return {"rows": rows(sides), "settings": list(settings)}


def _print(report: dict[str, Any]) -> None:
    print(
        f"torch {report['torch']}, {report['cpus']} CPU(s), OMP_NUM_THREADS={report['threads']} "
        f"per process; preset {report['preset']} ({DTYPE}), {report['counts']['requests']} "
        f"{report['workload']} requests all at t=0; median of {report['counts']['rounds']} round(s)"
    )
    print(
        f"  {'tp':>3}{'tok/s':>9}{'ratio':>8}{'TTFT p50':>10}{'TPOT p50':>10}{'step ms':>9}"
        f"{'AR ms':>8}{'AR p50':>8}{'AR share':>10}{'AR/step':>9}  tokens"
    )
    for row in report["rows"]:
        share = "n/a" if row["reduce_share"] is None else f"{row['reduce_share']:.1%}"
        print(
            f"  {row['tp']:>3}{fmt(row['output_tokens_per_s'], '9.2f')}"
            f"{fmt(row['ratio'], '7.3f')}x{fmt(row['ttft_p50_ms'], '10.1f')}"
            f"{fmt(row['tpot_p50_ms'], '10.1f')}{fmt(row['exec_ms_mean'], '9.2f')}"
            f"{fmt(row['reduce_ms_mean'], '8.2f')}{fmt(row['reduce_ms_p50'], '8.2f')}"
            f"{share:>10}{fmt(row['reduces_per_step'], '9.1f')}  {row['tokens_match']:.0%}"
        )
    print(
        "  (ratio: output tokens/s over the first size's; TTFT, TPOT in ms; step ms: execution "
        "per step; AR: all-reduce ms per step, mean and p50, its share of execution and count; "
        "tokens: requests with the first size's outputs)"
    )
    print(f"wall time {report['wall_s']:.1f} s")


def main(args: argparse.Namespace) -> int:
    sizes = parse_sizes(args.tp)
    counts = resolve_counts(args, COUNTS)
    preset = resolve_preset(args)
    threads = args.threads or max(1, (os.cpu_count() or 1) // 4)
    import torch

    start = time.perf_counter()
    try:
        figures = bench(preset, args.workload, sizes, counts, threads)
    except RunError as e:
        print(f"ringfence bench tp: {e}", file=sys.stderr)
        return 1
    report: dict[str, Any] = {
        "torch": torch.__version__,
        **environment(),
        "threads": threads,
        "preset": preset,
        "dtype": DTYPE,
        "workload": args.workload,
        "tp": list(sizes),
        "counts": counts,
        **figures,
        "wall_s": round(time.perf_counter() - start, 3),
    }
    _print(report)
    if args.json is not None:
        Path(args.json).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0

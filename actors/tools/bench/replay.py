"""``ringfence bench replay``: what trace-level logging costs, and how fast a run replays.

1. Logging cost: the same workload (``synthetic:pressure``, its first ``--requests``
   requests all at t=0, a device pool of about half what they need at once so sequences
   are preempted, ``sched.preemption=swap``, the host tier and local storage on) is
   launched with ``runtime.log_level=info`` and with ``runtime.log_level=trace``, the two
   sides alternating, ``--rounds`` times. Throughput is output tokens over
   ``summary.json``'s ``duration_s``; the figures are medians over the rounds and the
   ratio is trace / info (1.0: trace logging is free; below 1: its cost). The output
   tokens of the two sides are compared request by request, every round (they should
   all match; the fraction that does is reported, not asserted), and so are the bytes
   and lines of their logs (every ``<actor>-<rank>.jsonl``).
2. Replay speed: the trace run of the last round (or, with ``--large N``, one more trace
   run of N requests) is replayed in this process, ``--replays`` times:
   :func:`ringfence.actors.replay.log.read_run`, then
   ``ringfence.actors.replay.checks.check_run`` when that module is there. Reported:
   the events of the merged history, the median seconds of each part and of both, and
   events per second.

Each launch is a real ``ringfence launch`` in its own run dir under a temporary folder,
removed afterwards (``--keep DIR`` puts them under DIR and keeps them); every process
gets ``OMP_NUM_THREADS=--threads``. A failed launch (nonzero exit, timeout, no summary,
an aborted request) is an error, exit status 1. No figure has a target.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ringfence.actors.tools.bench import launcher
from ringfence.actors.tools.bench.e2e_pairs import (
    DTYPE,
    PRESSURE_BLOCKS_PER_REQUEST,
    PRESSURE_MIN_BLOCKS,
    TIERS_ON,
    Run,
    common_settings,
)
from ringfence.actors.tools.bench.launcher import RunError
from ringfence.actors.tools.bench.options import (
    add_counts,
    environment,
    resolve_counts,
    resolve_preset,
)

LEVELS = ("info", "trace")  # the baseline first

# name: (default, quick default, help)
COUNTS: dict[str, tuple[int, int, str]] = {
    "rounds": (3, 1, "rounds of the info and trace launches, alternating"),
    "requests": (16, 2, "requests of the workload"),
    "replays": (3, 1, "times the replay is timed"),
    "timeout": (300, 120, "seconds each launch may take"),
}

Check = Callable[[Any], Any]  # check_run(log) -> a CheckResult (its .violations)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument("--quick", action="store_true", help="tiny preset, a few requests (tests)")
    parser.add_argument("--preset", help="model preset (small; quick: tiny)")
    add_counts(parser, COUNTS)
    parser.add_argument(
        "--threads", type=int, help="OMP_NUM_THREADS of every process (CPUs / 4, at least 1)"
    )
    parser.add_argument(
        "--large",
        type=int,
        metavar="N",
        help="replay one more trace run of N requests (default: the last round's trace run)",
    )
    parser.add_argument(
        "--keep", type=Path, metavar="DIR", help="launch the runs under DIR and keep them"
    )


@dataclass(frozen=True, slots=True)
class Launch:
    """One launched run: its figures, its outputs and the size of its logs."""

    level: str  # runtime.log_level
    output_tokens: int
    duration_s: float  # summary.json's busy period
    tokens: dict[str, list[int]]  # output token ids by request id
    log_bytes: int  # every <actor>-<rank>.jsonl together
    log_lines: int
    wall_s: float  # the whole launch, start-up included

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0


def workload(preset: str, requests: int, level: str) -> Run:
    """The launched run: e2e's ``pressure`` settings with the tiers on, at ``level``."""
    blocks = max(PRESSURE_MIN_BLOCKS, requests * PRESSURE_BLOCKS_PER_REQUEST)
    settings = [*common_settings(preset, requests), f"cache.device_blocks={blocks}"]
    settings += ["sched.preemption=swap", *TIERS_ON, f"runtime.log_level={level}"]
    return Run("pressure", requests, tuple(settings))


def log_size(run_dir: Path) -> tuple[int, int]:
    """(bytes, lines) of the run's logs: what :func:`read_run` reads."""
    from ringfence.actors.replay.log import NOT_LOGS

    size = lines = 0
    for path in run_dir.glob("*.jsonl"):
        if path.name not in NOT_LOGS:
            data = path.read_bytes()
            size += len(data)
            lines += data.count(b"\n")
    return size, lines


def launch(run: Run, run_dir: Path, *, level: str, threads: int, timeout: float) -> Launch:
    """``ringfence launch`` the run into ``run_dir`` (kept; its parent holds the output)."""
    what = f"{run.workload} launch at {level}"
    done = launcher.run(
        run_dir,
        [*run.settings, f"actors.worker.threads={threads}"],
        what=what,
        timeout=timeout,
        workload=f"synthetic:{run.workload}",
        env={"OMP_NUM_THREADS": str(threads)},
        needs_summary=True,
    )
    summary = done.summary
    if summary["requests"]["aborted"] or not summary["duration_s"]:
        raise RunError(f"{what}: {summary['requests']}, no throughput")
    log_bytes, log_lines = log_size(run_dir)
    return Launch(
        level=level,
        output_tokens=int(summary["tokens"]["output"]),
        duration_s=float(summary["duration_s"]),
        tokens={line["id"]: list(line["token_ids"]) for line in done.outputs},
        log_bytes=log_bytes,
        log_lines=log_lines,
        wall_s=done.wall_s,
    )


def load_check() -> Check:
    """``replay.checks.check_run`` (imported only when the benchmark runs)."""
    from ringfence.actors.replay.checks import check_run

    return check_run


def time_replay(run_dir: Path, replays: int, check: Check | None) -> dict[str, Any]:
    """Replay ``run_dir`` ``replays`` times: median seconds of read_run and check_run."""
    from ringfence.actors.replay.log import read_run

    reads: list[float] = []
    checks: list[float] = []
    events = violations = warnings = 0
    traced = False
    for _ in range(replays):
        start = time.perf_counter()
        log = read_run(run_dir)
        reads.append(time.perf_counter() - start)
        if check is not None:
            start = time.perf_counter()
            found: Any = check(log)
            checks.append(time.perf_counter() - start)
            violations = len(found.violations if hasattr(found, "violations") else found)
        events, warnings = len(log.history), len(log.warnings)
        traced = log.traced
        del log  # not two merged histories in memory at once
    read_s = statistics.median(reads)
    check_s = statistics.median(checks) if checks else None
    total_s = statistics.median(
        [r + c for r, c in zip(reads, checks, strict=True)] if checks else reads
    )
    return {
        "run_dir": str(run_dir),
        "events": events,
        "traced": traced,
        "warnings": warnings,
        "violations": violations if check is not None else None,
        "checked": check is not None,
        "read_s": read_s,
        "check_s": check_s,
        "total_s": total_s,
        "read_events_per_s": _rate(events, read_s),
        "check_events_per_s": _rate(events, check_s),
        "total_events_per_s": _rate(events, total_s),
        "samples": {"read_s": reads, "check_s": checks},
    }


def _rate(events: int, seconds: float | None) -> float | None:
    return events / seconds if seconds else None


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _match(info: Sequence[Launch], trace: Sequence[Launch]) -> float:
    """Fraction of (round, request) pairs whose output tokens are the same on both sides."""
    same = total = 0
    for a, b in zip(info, trace, strict=True):
        ids = set(a.tokens) | set(b.tokens)
        same += sum(a.tokens.get(i) == b.tokens.get(i) for i in ids)
        total += len(ids)
    return same / total if total else 1.0


def summarize(info: Sequence[Launch], trace: Sequence[Launch]) -> dict[str, Any]:
    """Median figures per side and the trace / info ratios, from the launches of each side."""
    rows = []
    for name, unit, figure in (
        ("throughput", "tokens/s", lambda s: s.output_tokens_per_s),
        ("log bytes", "bytes", lambda s: float(s.log_bytes)),
        ("log lines", "lines", lambda s: float(s.log_lines)),
    ):
        a, b = _median([figure(s) for s in info]), _median([figure(s) for s in trace])
        rows.append({"name": name, "unit": unit, "info": a, "trace": b, "ratio": _ratio(b, a)})
    sides = {
        level: [
            {
                "output_tokens": s.output_tokens,
                "duration_s": s.duration_s,
                "output_tokens_per_s": s.output_tokens_per_s,
                "log_bytes": s.log_bytes,
                "log_lines": s.log_lines,
                "wall_s": round(s.wall_s, 3),
            }
            for s in side
        ]
        for level, side in zip(LEVELS, (info, trace), strict=True)
    }
    return {
        "rows": rows,
        "trace_over_info": rows[0]["ratio"],
        "tokens_match": _match(info, trace),
        "sides": sides,
    }


def bench(
    preset: str,
    counts: dict[str, int],
    threads: int,
    large: int | None,
    folder: Path,
    *,
    keep: bool,
    check: Check | None,
) -> dict[str, Any]:
    """The launches, alternating, then the replay of the last trace run (or a larger one)."""
    launches: dict[str, list[Launch]] = {level: [] for level in LEVELS}
    timeout = counts["timeout"]
    replayed: Path | None = None  # the trace run dir to replay, kept until then
    for round_no in range(counts["rounds"]):
        for level in LEVELS if round_no % 2 == 0 else LEVELS[::-1]:
            run_dir = folder / f"{level}-{round_no + 1}" / "run"
            run = workload(preset, counts["requests"], level)
            launches[level].append(
                launch(run, run_dir, level=level, threads=threads, timeout=timeout)
            )
            if level == "trace":
                if replayed is not None and not keep:
                    shutil.rmtree(replayed.parent, ignore_errors=True)
                replayed = run_dir
            elif not keep:
                shutil.rmtree(run_dir.parent, ignore_errors=True)
    figures = summarize(launches["info"], launches["trace"])
    large_run: dict[str, Any] | None = None
    if large is not None:
        run_dir = folder / f"trace-large-{large}" / "run"
        run = workload(preset, large, "trace")
        side = launch(run, run_dir, level="trace", threads=threads, timeout=timeout)
        if replayed is not None and not keep:
            shutil.rmtree(replayed.parent, ignore_errors=True)
        replayed = run_dir
        large_run = {
            "requests": large,
            "output_tokens": side.output_tokens,
            "duration_s": side.duration_s,
            "output_tokens_per_s": side.output_tokens_per_s,
            "log_bytes": side.log_bytes,
            "log_lines": side.log_lines,
        }
    assert replayed is not None  # rounds >= 1
    replay = time_replay(replayed, counts["replays"], check)
    replay["requests"] = large if large is not None else counts["requests"]
    replay["large_run"] = large_run
    if not keep:
        shutil.rmtree(replayed.parent, ignore_errors=True)
        replay["run_dir"] = None
    return {
        **figures,
        "replay": replay,
        "runs": {
            level: list(workload(preset, counts["requests"], level).settings) for level in LEVELS
        },
    }


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _print(report: dict[str, Any]) -> None:
    counts = report["counts"]
    print(
        f"torch {report['torch']}, {report['cpus']} CPU(s), OMP_NUM_THREADS={report['threads']}; "
        f"preset {report['preset']} ({DTYPE}), synthetic:pressure, {counts['requests']} "
        f"requests at t=0; median of {counts['rounds']} round(s)"
    )
    print(f"  {'log level':<12}{'unit':>10}{'info':>14}{'trace':>14}{'trace/info':>12}")
    for row in report["rows"]:
        spec = "14.1f" if row["unit"] == "tokens/s" else "14.0f"
        print(
            f"  {row['name']:<12}{row['unit']:>10}{_fmt(row['info'], spec)}"
            f"{_fmt(row['trace'], spec)}{_fmt(row['ratio'], '11.3f')}x"
        )
    print(
        f"  (throughput: output tokens / busy period; 1.0x = trace logging is free; "
        f"outputs equal on both sides: {report['tokens_match']:.0%} of requests)"
    )
    replay = report["replay"]
    check = "read_run + check_run" if replay["checked"] else "read_run only (no checks)"
    print(
        f"  replay of a trace run of {replay['requests']} requests, {replay['events']} events, "
        f"median of {counts['replays']}: {check}"
    )
    print(f"  {'part':<12}{'seconds':>10}{'events/s':>14}")
    parts = [("read", "read")]
    if replay["checked"]:
        parts += [("check", "check"), ("total", "total")]
    for label, key in parts:
        print(
            f"  {label:<12}{_fmt(replay[f'{key}_s'], '10.4f')}"
            f"{_fmt(replay[f'{key}_events_per_s'], '14,.0f')}"
        )
    if replay["checked"]:
        print(f"  ({replay['violations']} violation(s), {replay['warnings']} warning(s))")
    print(f"wall time {report['wall_s']:.1f} s")


def main(args: argparse.Namespace) -> int:
    counts = resolve_counts(args, COUNTS)
    if args.large is not None and args.large < 1:
        raise ValueError(f"counts must be >= 1, got --large {args.large}")
    preset = resolve_preset(args)
    threads = args.threads or max(1, (os.cpu_count() or 1) // 4)
    check = load_check()
    start = time.perf_counter()
    try:
        if args.keep is not None:
            folder = Path(args.keep)
            folder.mkdir(parents=True, exist_ok=True)
            figures = bench(preset, counts, threads, args.large, folder, keep=True, check=check)
        else:
            with tempfile.TemporaryDirectory(prefix="rf-bench-replay-") as tmp:
                folder = Path(tmp)
                figures = bench(
                    preset, counts, threads, args.large, folder, keep=False, check=check
                )
    except RunError as e:
        print(f"ringfence bench replay: {e}", file=sys.stderr)
        return 1
    import torch  # loaded already by resolve_preset; for its version

    report: dict[str, Any] = {
        "torch": torch.__version__,
        **environment(),
        "threads": threads,
        "preset": preset,
        "dtype": DTYPE,
        "counts": counts,
        "large": args.large,
        **figures,
        "wall_s": round(time.perf_counter() - start, 3),
    }
    _print(report)
    if args.json is not None:
        Path(args.json).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0

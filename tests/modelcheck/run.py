"""``scripts/modelcheck``: every configuration of the models, every mutant, and the fence
rule against cache/fences.py; a table, and exit status 0 only when the models pass, every
mutant fails (an equivalent one passes) and every recorded fence covers what its op needs.

Usage: ``python -m modelcheck.run [--ci] [--only NAME ...] [--jobs N] [--traces N]
[--json FILE]`` with tests/ on sys.path (scripts/modelcheck sets it).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from modelcheck import spin
from modelcheck.configs import CONFIGS, MUTANTS, PROTOCOL, Config, Mutant, config

if TYPE_CHECKING:
    from modelcheck.tables import RecordingTracker

TRACES = 20  # scheduler traces whose fences the model recomputes (F)


@dataclass(frozen=True, slots=True)
class Row:
    """One line of the report: a configuration, or a mutant in its configuration."""

    name: str
    config: str
    search: str  # "exhaustive", "bitstate", "liveness"
    expected: str  # "pass" or "fail"
    result: spin.Result | None
    error: str = ""  # spin or the compiler failed

    @property
    def ok(self) -> bool:
        if self.result is None:
            return False
        failed = self.result.errors > 0
        if self.expected == "fail":
            return failed
        return not failed and (self.search == "bitstate" or self.result.complete)


def _check(folder: Path, c: Config, mutant: str | None, liveness: bool) -> spin.Result:
    defines: dict[str, int | bool] = dict(c.defines)
    if mutant:
        defines[mutant] = True
    return spin.verify(
        folder, c.model, defines, bitstate=c.bitstate, liveness=liveness, optimize=not c.ci
    )


def jobs_for(configs: Sequence[Config], mutants: Sequence[Mutant]) -> list[Callable[[Path], Row]]:
    """One job per configuration search and per mutant."""
    found: list[Callable[[Path], Row]] = []

    def job(name: str, c: Config, mutant: str | None, liveness: bool, expected: str) -> None:
        search = "liveness" if liveness else "bitstate" if c.bitstate else "exhaustive"

        def run(folder: Path) -> Row:
            try:
                result = _check(folder, c, mutant, liveness)
            except (spin.SpinError, OSError) as e:
                return Row(name, c.name, search, expected, None, str(e)[:500])
            return Row(name, c.name, search, expected, result)

        found.append(run)

    for c in configs:
        job(c.name, c, None, False, "pass")
        if c.liveness:
            job(f"{c.name} (done)", c, None, True, "pass")
    for m in mutants:
        job(m.flag, config(m.config), m.flag, m.liveness, "pass" if m.equivalent else "fail")
    return found


def fence_traces(count: int, folder: Path) -> dict[str, Any]:
    """F: ``count`` scheduler traces issued through the model's fence rule."""
    from modelcheck.tables import recording

    ops, over, failed = 0, 0, []
    for seed in range(count):
        tracker = recording(seed)
        ops += len(tracker.rows)
        out = table_check(tracker, folder / f"trace-{seed}")
        if "F holds" not in out:
            line = next((s for s in out.splitlines() if "violated" in s), out[-300:])
            failed.append(f"trace {seed}: {line.strip()}")
        else:
            over += int(out.split("F holds: ")[1].split("; ")[1].split()[0])
    return {"traces": count, "ops": ops, "over_fenced": over, "failed": failed}


def table_check(tracker: RecordingTracker, where: Path) -> str:
    """Spin's output for a recorded tracker's rows issued through the model (table mode)."""
    from modelcheck.tables import table_pml

    spin.prepare(where, PROTOCOL, {"table.pml": table_pml(tracker.rows, tracker.resets)})
    return spin.simulate(where, PROTOCOL, {"TABLE": True, "NOPS": 1, "ND": 16, "NH": 16}, 600)


def _fmt(n: float) -> str:
    return f"{n:,.0f}" if n >= 1000 else f"{n:g}"


def table(rows: Sequence[Row], fences: dict[str, Any] | None) -> str:
    lines = [
        f"{'check':<30}{'config':<15}{'search':<11}{'states':>13}{'MB':>8}{'s':>7}"
        f"{'trail':>7}  result"
    ]
    for r in rows:
        res = r.result
        if res is None:
            lines.append(f"{r.name:<30}{r.config:<15}{r.search:<11}{'':>35}  ERROR {r.error}")
            continue
        if r.expected == "fail":
            verdict = (
                ("fails as it must: " + res.violation) if r.ok else "PASSED: the mutant survived"
            )
        else:
            verdict = "passes" if r.ok else (res.violation or "INCOMPLETE search")
            if r.ok and r.name.startswith("MUT_"):
                verdict = "passes: an equivalent mutant"
        trail = "-" if res.trail_steps is None else str(res.trail_steps)
        lines.append(
            f"{r.name:<30}{r.config:<15}{r.search:<11}{_fmt(res.states):>13}"
            f"{res.memory_mb:>8.0f}{res.seconds:>7.1f}{trail:>7}  {verdict}"
        )
    if fences is not None:
        state = "; ".join(fences["failed"]) or (
            f"every fence safe ({fences['over_fenced']} above the model's rule)"
        )
        lines.append(
            f"fence rule (F): {fences['ops']} ops of {fences['traces']} scheduler traces "
            f"through the model: {state}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/modelcheck", description=__doc__)
    parser.add_argument("--ci", action="store_true", help="the small configurations only")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these configurations or mutants")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="runs at once")
    parser.add_argument("--traces", type=int, default=TRACES, help="scheduler traces for F")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the results here")
    args = parser.parse_args(argv)
    configs = [c for c in CONFIGS if c.ci or not args.ci]
    mutants = [m for m in MUTANTS if config(m.config) in configs]
    if args.only:
        configs = [c for c in configs if c.name in args.only]
        mutants = [m for m in mutants if m.flag in args.only]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rf-modelcheck-") as tmp:
        work = jobs_for(configs, mutants)
        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            rows = list(pool.map(lambda ij: ij[1](Path(tmp) / str(ij[0])), enumerate(work)))
        fences = fence_traces(args.traces, Path(tmp)) if args.traces and not args.only else None
    print(table(rows, fences))
    bad = [r for r in rows if not r.ok] + ([None] if fences and fences["failed"] else [])
    print(f"{len(rows)} checks in {time.perf_counter() - start:.0f} s: "
          f"{'all as expected' if not bad else f'{len(bad)} NOT as expected'}")  # fmt: skip
    if args.json is not None:
        found = [{**asdict(r), "ok": r.ok} for r in rows]
        for entry in found:
            if entry["result"] is not None:
                entry["result"].pop("output", None)
        args.json.write_text(json.dumps({"checks": found, "fences": fences}, indent=2))
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())

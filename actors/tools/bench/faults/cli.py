"""``ringfence bench faults``: the fault matrix, one real run per row, and what each lost.

Each row launches the engine topology on the ``pressure`` workload (or the row's own
set-up), injects its fault (see :mod:`ringfence.actors.tools.bench.faults.runner`) and
prints: the fault, the times it was injected, the requests completed, the requests with a
token that differs from the plain loop's, hangs (a run past its deadline, or actors alive after
their supervisor died), the shared-memory names left behind, and whether
``ringfence replay --redrive`` passed on the run's logs. The first row injects nothing:
the baseline every other row is read against. Exit status 0 when every row is as
expected, 1 otherwise.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import orjson

COLUMNS = (
    ("fault", 28),
    ("injected", 8),
    ("completed", 9),
    ("wrong tokens", 12),
    ("hangs", 5),
    ("leaked names", 12),
    ("replay", 7),
    ("exit", 4),
    ("seconds", 7),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument("--quick", action="store_true", help="4 requests a row, fewer kills")
    parser.add_argument("--only", nargs="+", metavar="FAULT", help="run only these rows")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a row may take")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep the runs under DIR")


def main(args: argparse.Namespace) -> int:
    from ringfence.actors.tools.bench.faults.matrix import matrix
    from ringfence.actors.tools.bench.faults.runner import run_scenario

    scenarios = matrix(args.quick)
    if args.only:
        known = {s.name for s in scenarios}
        unknown = [name for name in args.only if name not in known]
        if unknown:
            raise ValueError(f"--only: unknown fault(s) {unknown}; known: {sorted(known)}")
        scenarios = [s for s in scenarios if s.name in args.only]
    start = time.perf_counter()
    print(_line([name for name, _ in COLUMNS]))
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="rf-bench-faults-") as tmp:
        folder = Path(args.keep) if args.keep is not None else Path(tmp)
        for scenario in scenarios:
            outcome = run_scenario(scenario, folder, timeout=args.timeout)
            outcomes.append(outcome)
            print(_row(outcome), flush=True)
            for note in outcome.notes:
                print(f"    note: {note}")
            for info in outcome.info:
                print(f"    {info}")
            if outcome.replay not in ("ok", "skipped"):
                print(f"    replay: {outcome.replay}")
    print(
        "(completed: of the requests each run was given; wrong tokens: completed requests "
        "whose tokens differ from the plain loop with no tiers; replay: ringfence replay "
        f"--redrive on the run's logs) wall time {time.perf_counter() - start:.1f} s"
    )
    if args.json:
        report = [asdict(o) | {"ok": o.ok} for o in outcomes]
        Path(args.json).write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0 if all(o.ok for o in outcomes) else 1


def _row(outcome: object) -> str:
    from ringfence.actors.tools.bench.faults.runner import Outcome

    assert isinstance(outcome, Outcome)
    replay = outcome.replay if outcome.replay in ("ok", "skipped") else "FAIL"
    exit_code = "hang" if outcome.exit_code is None else str(outcome.exit_code)
    return _line(
        [
            outcome.fault,
            str(outcome.injected),
            f"{outcome.completed}/{outcome.requests}",
            str(outcome.wrong_tokens),
            str(outcome.hangs),
            str(outcome.leaked_names),
            replay,
            exit_code,
            f"{outcome.seconds:.1f}",
        ]
    )


def _line(cells: list[str]) -> str:
    return "  ".join(
        cell.ljust(width) if i == 0 else cell.rjust(width)
        for i, (cell, (_, width)) in enumerate(zip(cells, COLUMNS, strict=True))
    )

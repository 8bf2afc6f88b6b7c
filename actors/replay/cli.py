"""``ringfence replay RUN_DIR``: check, explain and visualize a run from its logs alone.

Reads and merges every actor's log in happens-before order (``log.py``), runs the
protocol checks (``checks.py``) and prints what was checked, then either "ok" or
the first violation with the events around it in the merged history, and the others
in brief. Exit status 0 when every check holds, 1 otherwise (2: the run dir cannot be
read). Options add to that:

- ``--trace FILE``: a Chrome trace event file for Perfetto (``trace.py``);
- ``--request ID``: the life of one request (``request.py``);
- ``--redrive``: repeat the engine's scheduler calls on a fresh scheduler and report the
  first decision that differs (``redrive.py``); a difference is exit status 1.

Most checks need the engine's trace (``runtime.log_level=trace``); at ``info`` the
report names the checks it could not make.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

from ringfence.actors.replay.checks import CHECKS, check_run
from ringfence.actors.replay.findings import CheckResult, Violation
from ringfence.actors.replay.log import ReplayError, read_run
from ringfence.actors.replay.records import Entry, RunLog

CONTEXT_BEFORE = 8  # history entries shown before a violation
CONTEXT_AFTER = 4
MORE_SHOWN = 20  # further violations listed in brief


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the run dir to replay")
    parser.add_argument("--trace", type=Path, metavar="FILE", help="write a Perfetto trace")
    parser.add_argument("--request", metavar="ID", help="print the life of one request")
    parser.add_argument(
        "--redrive",
        action="store_true",
        help="re-drive a fresh scheduler from the logged calls and compare its decisions",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="print only the verdict and any violation"
    )


def main(args: argparse.Namespace) -> int:
    out = sys.stdout
    started = time.perf_counter()
    try:
        log = read_run(args.run_dir)
    except (ReplayError, OSError) as e:
        print(f"ringfence replay: {e}", file=sys.stderr)
        return 2
    result = check_run(log)
    elapsed = time.perf_counter() - started
    for warning in log.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    write_report(log, result, out, quiet=args.quiet, elapsed_s=elapsed)
    code = 0 if result.ok else 1
    if args.redrive:
        code = max(code, _redrive(log, out))
    if args.request:
        from ringfence.actors.replay.request import request_life

        try:
            lines = request_life(log, args.request)
        except KeyError as e:
            print(f"ringfence replay: {e.args[0]}", file=sys.stderr)
            return 2
        print("", file=out)
        for line in lines:
            print(line, file=out)
    if args.trace:
        from ringfence.actors.replay.profiles import profile_files, read_profile
        from ringfence.actors.replay.trace import write_trace

        profiled = []
        for path in profile_files(log.run_dir):
            try:
                profiled += read_profile(path)
            except ValueError as e:  # a profile cut short by a kill: the rest still shows
                print(f"warning: {e}", file=sys.stderr)
        count = write_trace(log, args.trace, profiled)
        with_profiles = f", {len(profiled)} from profiles" if profiled else ""
        print(
            f"trace: {count} events{with_profiles} written to {args.trace} (open in "
            "ui.perfetto.dev)",
            file=out,
        )
    return code


def write_report(
    log: RunLog, result: CheckResult, out: TextIO, *, quiet: bool = False, elapsed_s: float = 0.0
) -> None:
    """The checks and their verdict (see the module docstring)."""
    events = len(log.history)
    level = "trace" if log.traced else "info"
    rate = f", {events / elapsed_s:,.0f} events/s" if elapsed_s > 0 else ""
    print(
        f"replay {log.run_dir}: {events:,} events from {len(log.sources)} logs "
        f"({level} level), merged in happens-before order{rate}",
        file=out,
    )
    if not quiet:
        failed = {v.check for v in result.violations}
        for check, text in CHECKS.items():
            mark = "FAIL" if check in failed else "ok  "
            print(f"  {mark} {check:<9} {text}", file=out)
        for skipped in result.skipped:
            print(f"  skipped: {skipped}", file=out)
        for item in result.in_flight[:MORE_SHOWN]:
            print(f"  in flight at the end: {item}", file=out)
        if len(result.in_flight) > MORE_SHOWN:
            print(f"  ... and {len(result.in_flight) - MORE_SHOWN} more in flight", file=out)
    if result.ok:
        print("ok: every check holds", file=out)
        return
    first = result.violations[0]
    count = len(result.violations)
    print(f"FAIL: {count} violation{'s' if count > 1 else ''}; the first:", file=out)
    print(f"  [{first.check}] {first.message}", file=out)
    _context(log, first, out)
    for more in result.violations[1 : 1 + MORE_SHOWN]:
        where = more.at.where if more.at else "?"
        print(f"  [{more.check}] {more.message} ({where})", file=out)
    if count > 1 + MORE_SHOWN:
        print(f"  ... and {count - 1 - MORE_SHOWN} more", file=out)


def _context(log: RunLog, violation: Violation, out: TextIO) -> None:
    """The merged history around the violation; its own entries marked ``>>``."""
    at = violation.at
    if at is None:
        return
    marked = {id(e) for e in violation.entries}
    print("  around it, in happens-before order:", file=out)
    for entry in log.around(at, CONTEXT_BEFORE, CONTEXT_AFTER):
        print(f"  {'>>' if id(entry) in marked else '  '} {entry.describe()}", file=out)
    earlier = [e for e in violation.entries[1:] if not _near(log, at, e)]
    for entry in earlier:
        print(f"  >> (earlier) {entry.describe()}", file=out)


def _near(log: RunLog, at: Entry, entry: Entry) -> bool:
    return at.order - CONTEXT_BEFORE <= entry.order <= at.order + CONTEXT_AFTER


def _redrive(log: RunLog, out: TextIO) -> int:
    from ringfence.actors.replay.redrive import redrive

    try:
        result = redrive(log)
    except ValueError as e:
        print(f"redrive: not possible: {e}", file=out)
        return 1
    print(
        f"redrive: {result.calls} scheduler calls, {result.rounds} rounds, {result.ops} ops "
        f"and {result.decisions} decisions compared",
        file=out,
    )
    if result.divergence is None:
        print("redrive ok: the fresh scheduler made every logged decision", file=out)
        return 0
    entry = result.divergence.entry
    print(f"redrive FAIL at {entry.where}: {result.divergence.message}", file=out)
    for near in log.around(entry, CONTEXT_BEFORE, 0):
        if near.source == entry.source:
            print(f"  {'>>' if near is entry else '  '} {near.describe()}", file=out)
    return 1

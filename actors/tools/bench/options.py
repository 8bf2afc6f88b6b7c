"""Options shared by the actors' benchmarks: counts with full and ``--quick`` defaults, a preset.

Standard library only, so ``ringfence --help`` never loads torch.
"""

from __future__ import annotations

import argparse
import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

# name: (default, quick default, help)
Counts = Mapping[str, tuple[int, int, str]]


def add_counts(parser: argparse.ArgumentParser, counts: Counts) -> None:
    """One ``--name`` option per count (underscores become dashes)."""
    for name, (default, quick, text) in counts.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, dest=name, type=int, help=f"{text} ({default}; quick {quick})")


def resolve_counts(args: argparse.Namespace, counts: Counts) -> dict[str, int]:
    """Each count as given, else its quick or full default; ValueError naming any below 1
    (``--threads`` too, when given)."""
    resolved = {
        name: value if (value := getattr(args, name)) is not None else quick if args.quick else full
        for name, (full, quick, _) in counts.items()
    }
    bad = [f"--{k.replace('_', '-')} {v}" for k, v in resolved.items() if v < 1]
    threads = getattr(args, "threads", None)
    if threads is not None and threads < 1:
        bad.append(f"--threads {threads}")
    if bad:
        raise ValueError(f"counts must be >= 1, got {', '.join(bad)}")
    return resolved


def resolve_preset(args: argparse.Namespace) -> str:
    """``--preset``, else ``tiny`` with ``--quick`` and ``small`` without; ValueError if unknown."""
    from ringfence.actors.model.decoder import PRESETS  # torch: only once the benchmark runs

    preset: str = args.preset or ("tiny" if args.quick else "small")
    if preset not in PRESETS:
        raise ValueError(f"--preset: unknown preset {preset!r}; known: {sorted(PRESETS)}")
    return preset


def environment() -> dict[str, Any]:
    """Where the figures were measured (every bench's report opens with it)."""
    return {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
    }


def add_overrides(parser: argparse.ArgumentParser, after: str) -> None:
    """``--set KEY=VALUE`` (repeatable, into ``args.overrides``): config overrides for every
    run of the benchmark, applied after its own defaults ``after``."""
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="overrides",
        help=f"a config override for every run, after {after} (repeatable)",
    )


def plot_path(args: argparse.Namespace, default: str) -> Path:
    """Where a benchmark's PNG goes: ``--plot``, else beside ``--json``, else ``default``."""
    if args.plot is not None:
        return Path(args.plot)
    if args.json is not None:
        return Path(args.json).with_suffix(".png")
    return Path(default)

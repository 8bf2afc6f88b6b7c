"""The executors' profiler traces (``transfer.profile``) read onto a run's clock, for ``--trace``.

Each ``profile-<instance>.<incarnation>.json`` in a run dir is torch's Chrome trace of one
executor process (``actors/executors/profiling.py``). Its timestamps are the profiler's own
clock; the range named ``ringfence.clock <wall ns>``, opened right after the executor read
the wall clock, pins it to the logs' wall clock. Kept: the ranges the executors name their
ops with and every other user range, and on a GPU the kernels, copies and memsets of each
stream, the device's timeline; the host-side torch ops are left out (tens of thousands a
run, and the ranges already say which op ran).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import orjson

CLOCK: Final = "ringfence.clock"  # actors/executors/profiling.py's CLOCK
HOST: Final = frozenset({"user_annotation"})
DEVICE: Final = frozenset({"gpu_user_annotation", "kernel", "gpu_memcpy", "gpu_memset"})


@dataclass(frozen=True, slots=True)
class ProfiledSlice:
    """One kept event of a profile, on the run's wall clock."""

    source: str  # the executor's log stem, "worker-0"
    track: str  # "ops (thread 123)" on the host, "gpu 0 stream 7" on the device
    name: str
    category: str
    start: float  # seconds, wall clock
    duration: float  # seconds
    args: dict[str, Any]


def profile_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("profile-*.json"))


def read_profile(path: Path) -> list[ProfiledSlice]:
    """The kept events of one profile file; ValueError naming the file when it has no clock
    range or is not a trace."""
    source = path.name.removeprefix("profile-").rsplit(".", 2)[0]
    try:
        events = orjson.loads(path.read_bytes())["traceEvents"]
    except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as error:
        raise ValueError(f"{path}: not a profiler trace: {error}") from None
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    clock = next((e for e in complete if str(e.get("name", "")).startswith(f"{CLOCK} ")), None)
    if clock is None:
        raise ValueError(f"{path}: no {CLOCK} range to place it on the run's clock")
    offset = int(str(clock["name"]).split()[1]) / 1e9 - float(clock["ts"]) / 1e6
    kept = []
    for e in complete:
        category = str(e.get("cat", ""))
        if e is clock or category not in HOST | DEVICE:
            continue
        if category in DEVICE:
            track = f"gpu {e.get('pid')} stream {e.get('tid')}"
        else:
            track = f"ops (thread {e.get('tid')})"
        kept.append(
            ProfiledSlice(
                source=source,
                track=track,
                name=str(e.get("name", "")),
                category=category,
                start=float(e["ts"]) / 1e6 + offset,
                duration=float(e.get("dur", 0.0)) / 1e6,
                args=e.get("args") or {},
            )
        )
    return kept

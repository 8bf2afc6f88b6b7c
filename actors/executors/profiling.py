"""``transfer.profile`` (debug): a torch profiler trace of a lane executor's ops, for a timeline.

With it on, each lane executor's process records torch's profiler (the CPU, and on a GPU
the kernels and copies CUPTI sees) from its start to its stop, and exports a Chrome trace
to ``<run dir>/profile-<instance>.<incarnation>.json``. Each op runs inside a range named
as ``ringfence replay`` names it (``step 12``, ``swap-out 4``, ``write-back 5``), so the
device work it launched sits under it.

The profiler keeps its own clock. Right after reading the wall clock, the executor opens a
range named ``ringfence.clock <wall ns>``; ``ringfence replay --trace`` reads that range's
start to put every event of the file on the run's clock (``actors/replay/profiles.py``), so
the Worker's kernels, the lanes' copies and the protocol's ops land on one timeline.

A lane hosted in another actor's process (``runtime/hosting.py``) records no file of its
own: a process runs one profiler. Its host's profile has the lane's device copies (CUPTI sees
every thread's), not its op ranges (torch records those per thread); its ops are on the
timeline from its log, as every op is. Owned by the executor's thread.
"""

from __future__ import annotations

import contextlib
import time
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

CLOCK = "ringfence.clock"  # the range whose start pins the profiler's clock to the wall clock
NAMES = {"in": "swap-in", "out": "swap-out", "write": "write-back", "read": "prefetch"}


def profile_path(run_dir: Path, instance: str, incarnation: int) -> Path:
    return run_dir / f"profile-{instance}.{incarnation}.json"


def op_range(lane: str, number: int, direction: str = "") -> str:
    """The range of an op, as replay names the op: ``step 12``, ``swap-out 4``."""
    return f"{NAMES.get(direction, lane)} {number}"


class LaneProfile:
    """One executor's profiler: :meth:`start`, a :meth:`range` per op, :meth:`stop`."""

    def __init__(self, path: Path, *, cuda: bool) -> None:
        self.path = path
        self.cuda = cuda
        self._profiler: Any = None
        self.started = False

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU]
        if self.cuda:
            activities.append(ProfilerActivity.CUDA)
        self.started = True
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()
        wall = time.time_ns()
        with record_function(f"{CLOCK} {wall}"):
            pass

    def range(self, name: str) -> AbstractContextManager[Any]:
        """A named range around an op (nothing once stopped)."""
        if self._profiler is None:
            return contextlib.nullcontext()
        from torch.profiler import record_function

        return record_function(name)

    def stop(self) -> None:
        """Stop and write the trace (idempotent); a run dir that cannot take it loses it."""
        profiler, self._profiler = self._profiler, None
        if profiler is None:
            return
        profiler.__exit__(None, None, None)
        with contextlib.suppress(OSError):
            profiler.export_chrome_trace(str(self.path))

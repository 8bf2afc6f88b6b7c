"""The forward's and the sampling's share of a Worker's step, for its ``step.done`` line.

On CUDA the work is queued, so a host clock around it measures the launches, not the
kernels: :class:`StepTimer` records CUDA events on the current stream instead and reads
them after the step's final synchronize (the Worker's ``_execute``), when they have
completed. On the CPU it reads ``time.perf_counter_ns``. Owned by the Worker actor's thread.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    """Marks taken before the forward, after it, and after sampling: ``forward_ns`` and
    ``sample_ns`` of the step that took all three, else None (a step that ran no forward
    on this rank, or failed part way)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._marks: list[torch.cuda.Event | int] = []

    def mark(self) -> None:
        """Note the time now: an event queued on the stream on CUDA, the clock elsewhere."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record(torch.cuda.current_stream(self.device))
            self._marks.append(event)
        else:
            self._marks.append(time.perf_counter_ns())

    def swap(self, marks: list[torch.cuda.Event | int]) -> list[torch.cuda.Event | int]:
        """The marks since the last take, replaced by ``marks``: a step launched while
        another lands keeps its own (``worker.py``)."""
        taken, self._marks = self._marks, marks
        return taken

    def take(self) -> tuple[int | None, int | None]:
        """(forward_ns, sample_ns) of the marks since the last take, which it forgets. Call
        after the step's final synchronize: on CUDA the events must have completed."""
        marks, self._marks = self._marks, []
        if len(marks) != 3:
            return None, None
        if self.cuda:
            a, b, c = (m for m in marks if isinstance(m, torch.cuda.Event))
            return round(a.elapsed_time(b) * 1e6), round(b.elapsed_time(c) * 1e6)
        a_ns, b_ns, c_ns = (m for m in marks if isinstance(m, int))
        return b_ns - a_ns, c_ns - b_ns

"""What an engine that has just started asks of every executor (each inbox registers it)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Resync:
    """From an engine that has just started: announce yourself again (``WorkerReady`` or
    ``LaneReady`` with ``resync = epoch``) once every message before this one on the
    ring has been handled. The answer's watermark then covers every op an engine
    before this one sent: a restarted engine numbers its ops from there.
    """

    epoch: int  # the engine's epoch, echoed in the answer

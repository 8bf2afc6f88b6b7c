"""The ``[harness]`` section of the protocol harness (``harness.py``).

Kept apart from the harness, which imports torch: every config load reads this section
(the run's schema names it among its tools), and the supervisor imports no torch.
"""

from __future__ import annotations

import dataclasses

from ringfence.runtime.config import setting


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HarnessConfig:
    """[harness]: the protocol harness (a scripted engine over random programs)."""

    programs: int = setting(20, "random programs to run, one after another", ge=1)
    ops: int = setting(40, "ops per program (steps, swaps, write-backs, prefetches)", ge=1)
    seed: int = setting(0, "seed of the first program; program k uses seed + k", ge=0)
    check: bool = setting(True, "compare each program with its sequential interpretation")

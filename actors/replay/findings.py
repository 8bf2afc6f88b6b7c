"""What the checks of ``ringfence replay`` find: violations, and the work a run leaves open."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Final

from ringfence.actors.replay.records import Entry, Op

TOUCHED: Final = frozenset({"ok", "failed"})  # statuses of an op that may have touched blocks
OP_NAMES: Final = {
    "step": "step",
    "in": "swap-in",
    "out": "swap-out",
    "write": "write-back",
    "read": "prefetch",
}


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken rule: the check (a key of CHECKS), what happened, and the entries."""

    check: str
    message: str
    entries: tuple[Entry, ...]  # the first is where it shows; the rest are its causes

    @property
    def at(self) -> Entry | None:
        return self.entries[0] if self.entries else None


@dataclass(slots=True)
class CheckResult:
    """Every violation (in history order), what is still in flight, and what was checked."""

    violations: list[Violation] = field(default_factory=list)
    in_flight: list[str] = field(default_factory=list)  # ops and requests the log leaves open
    counts: Counter[str] = field(default_factory=Counter)  # what each check looked at
    skipped: list[str] = field(default_factory=list)  # checks the log level did not allow

    @property
    def ok(self) -> bool:
        return not self.violations


def op_name(op: Op) -> str:
    """``step 4``, ``swap-in 3``, ``write-back 7``."""
    return f"{OP_NAMES.get(op.kind, op.lane)} {op.number}"


def entries_of(*entries: Entry | None) -> tuple[Entry, ...]:
    return tuple(e for e in entries if e is not None)

"""The launch summary of a workload run: per-request records, their summary, the files,
the table ``ringfence launch`` prints and its progress line.

Pure and clock-free: times are given by the caller (seconds from the workload's start),
so the engine, the launcher and the benchmarks share one definition of TTFT, TPOT,
throughput and hit rate. Standard library and orjson only.

Files written into a run dir (see docs/design.md, "Run dirs and workload files"):

* ``outputs.jsonl``: one line per request, in the order given: ``id``, ``prompt_tokens``,
  ``token_ids``, ``finish_reason``, ``error`` (only when there is one), ``ttft_s``,
  ``tpot_s`` (null when unknown), ``cached_tokens`` (``device``, ``host``, ``storage``),
  ``preemptions`` and ``returning`` (whether it is a returning turn of a session, see
  :func:`ringfence.sched.workload.returning_turns`).
* ``summary.json``: what ``summarize`` returns, indented.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import orjson

from ringfence.actors.engine.percentiles import percentile, stats
from ringfence.actors.engine.run_errors import error_lines, group_errors
from ringfence.sched.request import TIERS, FinishReason

OUTPUTS_FILE = "outputs.jsonl"
SUMMARY_FILE = "summary.json"
_MIB = 1 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestRecord:
    """What became of one request of a workload; times are seconds from the workload's start."""

    id: str
    prompt_tokens: int  # length of the prompt in tokens
    token_ids: tuple[int, ...]  # the output tokens, in order
    finish_reason: str  # a FinishReason value: "stop", "length" or "abort"
    error: str = ""  # why it was aborted by a failure; empty when none
    arrival_s: float  # when it arrived
    first_token_s: float | None  # when its first output token was known; None if none was
    finish_s: float | None  # when it finished or was aborted; None if it never did
    cached_tokens: Mapping[str, int]  # prompt tokens served from each tier in TIERS
    preemptions: int = 0  # times the scheduler preempted it
    returning: bool = False  # a returning turn: its prompt extends an earlier one of its session

    def __post_init__(self) -> None:
        FinishReason(self.finish_reason)  # ValueError naming the bad value
        unknown = set(self.cached_tokens) - set(TIERS)
        if unknown:
            raise ValueError(
                f"request {self.id}: cached_tokens has unknown tiers {sorted(unknown)}"
            )

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: arrival to first output token; None without a token."""
        if self.first_token_s is None or not self.token_ids:
            return None
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens or no finish."""
        if self.first_token_s is None or self.finish_s is None or len(self.token_ids) < 2:
            return None
        return (self.finish_s - self.first_token_s) / (len(self.token_ids) - 1)

    def cached(self, tier: str) -> int:
        """Prompt tokens served from ``tier`` (0 when the record does not name it)."""
        return self.cached_tokens.get(tier, 0)

    def to_json_line(self) -> bytes:
        """One line of ``outputs.jsonl``, newline included."""
        line: dict[str, object] = {
            "id": self.id,
            "prompt_tokens": self.prompt_tokens,
            "token_ids": list(self.token_ids),
            "finish_reason": str(self.finish_reason),
        }
        if self.error:
            line["error"] = self.error
        line["ttft_s"] = self.ttft_s
        line["tpot_s"] = self.tpot_s
        line["cached_tokens"] = {tier: self.cached(tier) for tier in TIERS}
        line["preemptions"] = self.preemptions
        line["returning"] = self.returning
        return orjson.dumps(line, option=orjson.OPT_APPEND_NEWLINE)


def _turn_stats(values: Sequence[float]) -> dict[str, float | int | None]:
    return {
        "requests": len(values),
        "p50": percentile(values, 50) if values else None,
        "p95": percentile(values, 95) if values else None,
    }


def _rate(amount: float, duration_s: float) -> float | None:
    return amount / duration_s if duration_s > 0 else None


def summarize(
    records: Sequence[RequestRecord], *, duration_s: float, engine: Mapping[str, object]
) -> dict[str, Any]:
    """The summary of a run (the content of ``summary.json``).

    Token counts cover every record, aborted ones included; throughput counts only what
    was computed: the requests that ended without an error (a refused prompt never ran,
    a failed request's work is lost), so a run of refusals has 0 tokens per second.
    ``error_kinds`` groups the errors by kind (:func:`.run_errors.group_errors`). TTFT
    and TPOT are over the records that have them, and ``ttft_by_turn`` splits TTFT into
    first and returning turns (``requests`` counts the records with a TTFT). Rates and
    hit rates are None when their denominator is 0.
    ``engine`` (the engine's own counters, opaque here) is copied under ``"engine"``.
    """
    if duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    aborted = sum(r.finish_reason == FinishReason.ABORT for r in records)
    prompt_tokens = sum(r.prompt_tokens for r in records)
    output_tokens = sum(len(r.token_ids) for r in records)
    cached = {tier: sum(r.cached(tier) for r in records) for tier in TIERS}
    hit_rate: dict[str, float | None] = {
        tier: (count / prompt_tokens if prompt_tokens else None) for tier, count in cached.items()
    }
    hit_rate["total"] = sum(cached.values()) / prompt_tokens if prompt_tokens else None
    computed = [r for r in records if not r.error]
    computed_output = sum(len(r.token_ids) for r in computed)
    computed_tokens = sum(r.prompt_tokens for r in computed) + computed_output
    return {
        "requests": {
            "total": len(records),
            "finished": len(records) - aborted,
            "aborted": aborted,
            "errors": sum(bool(r.error) for r in records),
        },
        "tokens": {"prompt": prompt_tokens, "output": output_tokens},
        "duration_s": duration_s,
        "throughput": {
            "output_tokens_per_s": _rate(computed_output, duration_s),
            "total_tokens_per_s": _rate(computed_tokens, duration_s),
            "requests_per_s": _rate(len(computed), duration_s),
        },
        "ttft_s": stats([t for r in records if (t := r.ttft_s) is not None]),
        "tpot_s": stats([t for r in records if (t := r.tpot_s) is not None]),
        "ttft_by_turn": {
            turn: _turn_stats(
                [t for r in records if r.returning is returning and (t := r.ttft_s) is not None]
            )
            for turn, returning in (("first", False), ("returning", True))
        },
        "cached_tokens": cached,
        "hit_rate": hit_rate,
        "engine": dict(engine),
        "error_kinds": group_errors(records),
    }


def _write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: write a temporary sibling, then rename it over."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_run_report(
    run_dir: str | os.PathLike[str], records: Iterable[RequestRecord], summary: Mapping[str, Any]
) -> None:
    """Write ``outputs.jsonl`` (records in the order given) and ``summary.json`` into
    ``run_dir``; each file appears whole or not at all (the pair is not one atomic step)."""
    directory = Path(run_dir)
    _write_atomic(directory / OUTPUTS_FILE, b"".join(r.to_json_line() for r in records))
    _write_atomic(
        directory / SUMMARY_FILE,
        orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE),
    )


def _num(value: object, spec: str, scale: float | None = None) -> str:
    """``value`` (times ``scale``) formatted by ``spec``; ``-`` when it is not a number."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    if scale is not None:
        value *= scale
    return format(round(value) if spec == "d" else value, spec)


def _counts(value: object, prefix: str = "") -> list[tuple[str, float]]:
    """The numbers of a (possibly nested) mapping as ``(dotted name, number)`` pairs."""
    if not isinstance(value, Mapping):
        return []
    found: list[tuple[str, float]] = []
    for key, item in value.items():
        if isinstance(item, Mapping):
            found += _counts(item, f"{prefix}{key}.")
        elif isinstance(item, int | float) and not isinstance(item, bool):
            found.append((f"{prefix}{key}", item))
    return found


def _turn(stats: object) -> str:
    if not isinstance(stats, Mapping):
        return "-"
    return f"{_num(stats.get('p50'), '.1f', 1e3)}/{_num(stats.get('p95'), '.1f', 1e3)} ms"


def format_summary(summary: Mapping[str, Any]) -> str:
    """A fixed-width table of a summary, for the terminal; missing figures print as ``-``.
    Under it, one line per kind of error (:func:`.run_errors.error_lines`), if any."""

    def section(key: str) -> Mapping[str, Any]:
        value = summary.get(key)
        return value if isinstance(value, Mapping) else {}

    requests, tokens, rates = section("requests"), section("tokens"), section("throughput")
    cached, hit_rate, engine = section("cached_tokens"), section("hit_rate"), section("engine")
    rows = [
        (
            "requests",
            f"{_num(requests.get('total'), 'd')} total, {_num(requests.get('finished'), 'd')} "
            f"finished, {_num(requests.get('aborted'), 'd')} aborted, "
            f"{_num(requests.get('errors'), 'd')} errors",
        ),
        (
            "tokens",
            f"{_num(tokens.get('prompt'), 'd')} prompt, {_num(tokens.get('output'), 'd')} output",
        ),
        ("duration", f"{_num(summary.get('duration_s'), '.3f')} s"),
        (
            "throughput",
            f"{_num(rates.get('output_tokens_per_s'), '.1f')} output tok/s, "
            f"{_num(rates.get('total_tokens_per_s'), '.1f')} total tok/s, "
            f"{_num(rates.get('requests_per_s'), '.2f')} req/s",
        ),
    ]
    for key, name in (("ttft_s", "TTFT"), ("tpot_s", "TPOT")):
        stats = section(key)
        rows.append(
            (
                name,
                f"p50 {_num(stats.get('p50'), '.1f', 1e3)} ms, "
                f"p99 {_num(stats.get('p99'), '.1f', 1e3)} ms",
            )
        )
    turns = section("ttft_by_turn")
    first, returning = turns.get("first", {}), turns.get("returning", {})
    rows.append(
        (
            "TTFT turns",
            f"p50/p95: first turns {_turn(first)}, returning turns {_turn(returning)} "
            f"({_num(first.get('requests'), 'd')} and {_num(returning.get('requests'), 'd')} "
            "requests)",
        )
    )
    rows.append(
        (
            "cache hits",
            ", ".join(
                f"{tier} {_num(cached.get(tier), 'd')} ({_num(hit_rate.get(tier), '.1%')})"
                for tier in TIERS
            ),
        )
    )
    preemptions = _counts(engine.get("preemptions"))
    rows.append(("preemptions", ", ".join(f"{k} {_num(v, 'g')}" for k, v in preemptions) or "none"))
    moved = _counts(engine.get("bytes"))
    rows.append(
        ("bytes moved", ", ".join(f"{k} {_num(v, '.1f', 1 / _MIB)} MiB" for k, v in moved) or "-")
    )
    width = max(len(label) for label, _ in rows)
    table = [f"{label:<{width}}  {text}" for label, text in rows]
    return "\n".join(table + error_lines(summary.get("error_kinds")))


class Progress:
    """One terminal line of progress: requests done of total, output tokens per second.

    Clock-free: every ``update`` gives ``now`` (any clock, seconds); the rate is over the
    time since ``start`` (default: the first update's ``now``). A line is written at most
    every ``min_interval_s``, and always (once) when the last request is done. On a TTY the
    line is rewritten in place (``\\r``) and ``close`` ends it; elsewhere (a log file) each
    write is a line of its own. Owned by one thread.
    """

    def __init__(
        self,
        total: int,
        stream: IO[str] | None = None,
        min_interval_s: float = 0.5,
        *,
        start: float | None = None,
    ) -> None:
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        self.min_interval_s = min_interval_s
        self._start = start
        self._tty = self.stream.isatty()
        self._last_write: float | None = None
        self._last_done = -1
        self._width = 0  # length of the line on screen, to blank out what a shorter one leaves
        self._open = False  # a TTY line was written and not yet ended

    def update(self, done: int, now: float, *, tokens: int) -> None:
        """Report ``done`` requests finished and ``tokens`` output tokens so far, at ``now``."""
        if self._start is None:
            self._start = now
        finishing = done >= self.total and self._last_done < self.total
        if (
            not finishing
            and self._last_write is not None
            and now - self._last_write < self.min_interval_s
        ):
            return
        self._last_write, self._last_done = now, done
        elapsed = now - self._start
        rate = f"{tokens / elapsed:.1f}" if elapsed > 0 else "-"
        text = f"{done}/{self.total} requests, {tokens} tokens, {rate} tok/s"
        if self._tty:
            self.stream.write("\r" + text.ljust(self._width))
            self._width = len(text)
            self._open = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """End the progress line (idempotent)."""
        if self._open:
            self.stream.write("\n")
            self.stream.flush()
            self._open = False

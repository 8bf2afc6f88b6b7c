"""The serving benchmark's arithmetic: Poisson arrival times, and TTFT, ITL, TPOT and
throughput from what a streaming client saw of each request.

Pure and clock-free (times are given, in seconds on one clock), in the style of vLLM's
``benchmarks/benchmark_serving.py``:

* TTFT: from sending the request to the first chunk that carries output tokens;
* ITL: each gap between two consecutive chunks that carry tokens;
* TPOT: (last token chunk - first token chunk) / (output tokens - 1), for requests
  of at least two output tokens;
* throughput: over the busy period, from the first arrival to the end of the last request.

Percentiles are :func:`ringfence.actors.engine.percentiles.percentile`'s (numpy's linear
interpolation), so these figures and a launch's ``summary.json`` share one definition.
Standard library only.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ringfence.actors.engine.percentiles import stats


def parse_rate(text: str) -> float:
    """A request rate from the command line: a positive number of requests per second,
    or ``inf`` (every request at once); ValueError naming the text otherwise."""
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"--rates: {text!r} is not a number or 'inf'") from None
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"--rates: a rate must be > 0 requests/s or 'inf', got {text!r}")
    return rate


def rate_label(rate: float) -> str:
    """``inf`` or the rate as written without a trailing ``.0`` (``2``, ``0.5``)."""
    return "inf" if math.isinf(rate) else f"{rate:g}"


def poisson_arrivals(rate: float, count: int, *, seed: int) -> list[float]:
    """``count`` arrival times in seconds of a Poisson process of ``rate`` requests per
    second: the first at 0, then exponential gaps of mean ``1 / rate``. ``inf``: all at 0.

    The same (rate, count, seed) always gives the same times; each rate draws from its own
    generator, so adding a rate to a run changes no other rate's arrivals.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"rate must be > 0 or inf, got {rate}")
    if math.isinf(rate):
        return [0.0] * count
    # A string seed is hashed with SHA-512: stable across runs and Python versions.
    rng = random.Random(f"ringfence.bench.serve:{seed}:{rate!r}")
    arrivals, now = [], 0.0
    for _ in range(count):
        arrivals.append(now)
        now += rng.expovariate(rate)
    return arrivals


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    """What the client saw of one streamed request; times in seconds on one clock."""

    id: str
    sent_s: float  # when the request was sent
    chunk_s: tuple[float, ...]  # when each chunk that carried output tokens arrived
    chunk_tokens: tuple[int, ...]  # how many tokens each of those chunks carried
    end_s: float  # when the stream ended ([DONE], an error, or the connection dropped)
    token_ids: tuple[int, ...] = ()  # the output token ids, in order
    error: str = ""  # why the request failed; empty when it finished
    usage: Mapping[str, Any] | None = None  # the usage chunk's ``usage``, if one came

    def __post_init__(self) -> None:
        if len(self.chunk_s) != len(self.chunk_tokens):
            raise ValueError(
                f"request {self.id}: {len(self.chunk_s)} chunk times but "
                f"{len(self.chunk_tokens)} chunk token counts"
            )
        if any(n < 1 for n in self.chunk_tokens):
            raise ValueError(f"request {self.id}: a token chunk carries no token")
        if any(b < a for a, b in itertools.pairwise(self.chunk_s)):
            raise ValueError(f"request {self.id}: chunk times go backwards")

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ttft_s(self) -> float | None:
        """Sent to the first chunk with tokens; None without one."""
        return self.chunk_s[0] - self.sent_s if self.chunk_s else None

    @property
    def itl_s(self) -> list[float]:
        """The gaps between consecutive chunks with tokens."""
        return [b - a for a, b in itertools.pairwise(self.chunk_s)]

    @property
    def tpot_s(self) -> float | None:
        """(last token chunk - first) / (output tokens - 1); None below two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.chunk_s[-1] - self.chunk_s[0]) / (self.output_tokens - 1)


def summarize(timelines: Sequence[Timeline], *, duration_s: float) -> dict[str, Any]:
    """The figures of one load run: request counts, tokens, throughput over ``duration_s``
    (None when it is 0), and TTFT, TPOT and ITL over the requests that finished."""
    if duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    done = [t for t in timelines if not t.error]
    output_tokens = sum(t.output_tokens for t in done)
    return {
        "requests": {
            "total": len(timelines),
            "finished": len(done),
            "failed": len(timelines) - len(done),
        },
        "output_tokens": output_tokens,
        "duration_s": duration_s,
        "throughput": {
            "requests_per_s": len(done) / duration_s if duration_s > 0 else None,
            "output_tokens_per_s": output_tokens / duration_s if duration_s > 0 else None,
        },
        "ttft_s": stats([v for t in done if (v := t.ttft_s) is not None]),
        "tpot_s": stats([v for t in done if (v := t.tpot_s) is not None]),
        "itl_s": stats([gap for t in done for gap in t.itl_s]),
        "errors": sorted({t.error for t in timelines if t.error}),
    }


def busy_period(timelines: Sequence[Timeline], *, start_s: float) -> float:
    """From ``start_s`` (the first arrival) to the end of the last request (0 for none)."""
    return max((t.end_s for t in timelines), default=start_s) - start_s

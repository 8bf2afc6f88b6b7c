"""A prefill instance, a decode instance and a ``both`` instance as real ``ringfence serve``
processes, the first two on one shared storage directory, and requests sent to them.

:func:`pd_instances` starts the three at once and yields a :class:`Pd`; a router over
them is ``tests/routing.py``'s :func:`routed_urls`. Every instance runs the tiny preset in
float64 with greedy sampling, so the ``both`` instance's tokens are what the router's
must be, and logs at trace level, so that replay can redrive each run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from serving import Server, served, started

BLOCK_SIZE = 16
MODEL = (
    "model.preset=tiny",
    "model.dtype=float64",
    f"cache.block_size={BLOCK_SIZE}",
    "runtime.log_level=trace",
)


@dataclass
class Pd:
    prefill: Server
    decode: Server
    both: Server
    tier: Path  # the shared storage directory

    def urls(self) -> tuple[list[str], list[str]]:
        return [self.prefill.url], [self.decode.url]


def pd_sets(tier: Path) -> tuple[str, ...]:
    return (*MODEL, "cache.storage.backend=local", f"cache.storage.path={tier}")


@contextlib.contextmanager
def pd_instances(
    tmp_path: Path, *, decode_sets: Sequence[str] = (), prefill_sets: Sequence[str] = ()
) -> Iterator[Pd]:
    """The three instances until the block ends (each stopped by Ctrl-C, its names gone)."""
    tier = tmp_path / "tier"
    for name in ("prefill", "decode", "both"):
        (tmp_path / name).mkdir()
    with contextlib.ExitStack() as stack:
        prefill, decode, both = started(
            stack,
            [
                served(tmp_path / "prefill", *pd_sets(tier), "engine.role=prefill", *prefill_sets),
                served(
                    tmp_path / "decode",
                    *pd_sets(tier),
                    "engine.role=decode",
                    "sched.preemption=save",
                    *decode_sets,
                ),
                served(tmp_path / "both", *MODEL, "cache.storage.backend=none"),
            ],
        )
        yield Pd(prefill, decode, both, tier)


def completion(url: str, prompt: Sequence[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy completion of token ids from ``url`` (a router or an instance), answered 200."""
    body = {"prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "return_token_ids": True, **extra}  # fmt: skip
    with httpx.Client(base_url=url, timeout=120.0, trust_env=False) as client:
        answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    result: dict[str, Any] = answer.json()
    return result


def tokens(answer: dict[str, Any]) -> list[int]:
    ids: list[int] = answer["choices"][0]["token_ids"]
    return ids


def cached(answer: dict[str, Any]) -> dict[str, int]:
    tiers: dict[str, int] = answer["usage"]["ringfence"]["cached_tokens"]
    return tiers


def full_blocks(prompt: Sequence[int]) -> int:
    """Prompt tokens a decode instance can take from the tier: every full block but the
    last token's (the one it must compute to sample)."""
    return (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE

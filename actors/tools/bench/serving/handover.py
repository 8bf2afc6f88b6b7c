"""What the prefill/decode hand-over cost, read from the logs of one disaggregated run.

Three costs per block (docs/design.md, "Instances (prefill/decode disaggregation)"), each from
the lines that time it:

* write: the prefill instance's store lanes, ``lane.done`` of direction ``write``: the
  copy of host blocks into the shared tier (``copy_ns``; ``wait_ns`` is the op's wait for
  its fence, the swap-out that fills its host blocks);
* visible: the prefill engine's ``handover.done``: from the step that finished a prompt
  (its finish held) to the store watermark covering its writes (``wait_ms``), the time a
  prefill's answer waits so that its blocks are whole and visible when the router hears;
* prefetched: the decode instance's store lanes, ``lane.done`` of direction ``read``: the
  copy from the tier into host blocks, with the blocks that were missing.

With tensor parallelism every rank's lane moves its shard of each block: the figures
count rank-blocks (one per rank). The router's ``router.answered`` lines add the
request's view: the prefill stage's time, fallbacks, reserve retries, claims.

Pure: lines in, figures out (the caller reads the files).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson

from ringfence.actors.engine.percentiles import stats
from ringfence.actors.tools.bench import launcher

NS_PER_US = 1_000


def _per(total: float, count: int) -> float | None:
    return total / count if count else None


def lane_cost(lines: Iterable[Mapping[str, Any]], direction: str) -> dict[str, Any]:
    """The ``ok`` store ops of ``direction`` (``write`` or ``read``) among a store lane's
    lines: ops, blocks, missing blocks, copy microseconds per block (all copy time over all
    blocks), and per op the copy and fence-wait milliseconds (p50, p99, mean)."""
    done = [
        line
        for line in lines
        if line.get("event") == "lane.done"
        and line.get("lane") == "store"
        and line.get("direction") == direction
        and line.get("status") == "ok"
    ]
    blocks = sum(int(line.get("blocks") or 0) for line in done)
    copy_ns = [int(line.get("copy_ns") or 0) for line in done]
    return {
        "ops": len(done),
        "blocks": blocks,
        "missing": sum(len(line.get("missing") or ()) for line in done),
        "us_per_block": _per(sum(copy_ns) / NS_PER_US, blocks),
        "copy_ms": stats([ns / 1e6 for ns in copy_ns]),
        "wait_ms": stats([int(line.get("wait_ns") or 0) / 1e6 for line in done]),
    }


def visible_cost(lines: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """A prefill engine's ``handover.done`` lines: requests, blocks written, the wait from a
    prompt's last step to its writes' watermark (ms: p50, p99, mean) and per block."""
    done = [line for line in lines if line.get("event") == "handover.done"]
    waits = [float(line.get("wait_ms") or 0.0) for line in done]
    blocks = sum(int(line.get("blocks") or 0) for line in done)
    return {
        "requests": len(done),
        "blocks": blocks,
        "wait_ms": stats(waits),
        "ms_per_block": _per(sum(waits), blocks),
    }


def routed_cost(lines: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The router's ``router.answered`` lines: requests by outcome, the prefill stage's
    seconds (p50, p99, mean), blocks the prefills stored, fallbacks by why, reserve retries,
    and requests claimed more than once (an expired reservation)."""
    answered = [line for line in lines if line.get("event") == "router.answered"]
    return {
        "requests": len(answered),
        "outcomes": dict(Counter(str(line.get("outcome")) for line in answered)),
        "prefill_s": stats([float(v) for line in answered if (v := line.get("prefill_s"))]),
        "stored_blocks": sum(int(line.get("stored_blocks") or 0) for line in answered),
        "fallbacks": dict(Counter(str(f) for line in answered if (f := line.get("fallback")))),
        "reserve_retries": sum(int(line.get("retries") or 0) for line in answered),
        "reclaimed": sum(1 for line in answered if int(line.get("claims") or 0) > 1),
    }


def _ranks(run_dir: Path, actor: str) -> list[dict[str, Any]]:
    """Every rank's lines of ``actor`` in ``run_dir`` (``store-0.jsonl``, ``store-1.jsonl``)."""
    ranks = sorted(run_dir.glob(f"{actor}-*.jsonl"))
    if not ranks:
        raise launcher.RunError(f"{run_dir}: no {actor}-<rank>.jsonl log")
    return [line for path in ranks for line in launcher.read_log(run_dir, path.stem)]


def router_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a router's stderr (other lines, such as a library's warning, are
    not the router's log and are skipped); RunError if the file cannot be read."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise launcher.RunError(f"{path}: cannot read the router's log: {e}") from None
    lines = []
    for raw in data.splitlines():
        if raw.startswith(b"{"):
            with contextlib.suppress(orjson.JSONDecodeError):
                lines.append(orjson.loads(raw))
    return lines


def read_handover(
    prefill: Path, decode: Path, router: Iterable[Mapping[str, Any]]
) -> dict[str, Any]:
    """The hand-over's figures of one run: the prefill and decode instances' run dirs and
    the router's log lines (:func:`router_lines`). RunError naming a log that is missing
    or broken."""
    return {
        "write": lane_cost(_ranks(prefill, "store"), "write"),
        "visible": visible_cost(launcher.read_log(prefill, "engine-0")),
        "prefetched": lane_cost(_ranks(decode, "store"), "read"),
        "router": routed_cost(router),
    }

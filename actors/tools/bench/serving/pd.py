"""``ringfence bench pd``: prefill/decode disaggregation against one instance doing both.

The same requests (``synthetic:interleaved`` by default: streams decoding while long
prompts arrive, each at its own arrival time) are streamed over HTTP, by the serving
benchmark's client (:mod:`.client`), from two sides, each a fresh set of processes on the
same ``--set`` overrides:

* both: one ``ringfence serve`` with ``engine.role=both`` and a local storage tier of
  its own;
* pd: a ``ringfence serve`` with ``engine.role=prefill`` and one with ``engine.role=decode``
  (``sched.preemption=save``) sharing one local storage directory, behind a ``ringfence
  router`` (its own process, as a user runs it).

Each side gets the machine's CPUs: the both instance's Worker torch's default threads (one
per CPU), each of the pd side's two Workers half of them (``actors.worker.threads``; a
``--set`` of it wins). Two Workers of a thread per CPU each would oversubscribe the
machine: measured here, that made every prefill five times slower and the pd side's
inter-token p99 ten times the both side's, the opposite of what it measures with the
CPUs split.

Rounds alternate the sides (both, pd, both, pd, ...); the report gives the median over
rounds of each figure: TTFT, ITL and TPOT p50/p99 per class of request (the id's first
word: ``stream`` and ``long`` for interleaved) and over all, output-token throughput, the
pd/both ratios, the share of requests whose tokens are the same on both sides, the share
of prompt tokens the decode instance took from the tier, and the hand-over's cost per
block (:mod:`.handover`). ITL p99 of the streams is where disaggregation should help: on
the pd side no prefill runs in the decode instance's steps.

A server that fails to start or exit, or a request that fails, is an error (exit status
1) after the table, JSON and plot are written.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import orjson

from ringfence.actors.tools.bench.launcher import RunError
from ringfence.actors.tools.bench.options import add_overrides, environment, plot_path
from ringfence.actors.tools.bench.serving import pd_report
from ringfence.actors.tools.bench.serving.cli import load_requests
from ringfence.actors.tools.bench.serving.client import LoadRequest

DEFAULT_SETTINGS = ("model.preset=small",)  # the main job's; --set comes after and wins
WORKLOAD = "interleaved"
DEFAULT_REQUESTS = 16
START_S = 180.0  # a server's start-up (processes importing torch, the model built)
STOP_S = 60.0
_T = TypeVar("_T")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument(
        "--workload",
        default=WORKLOAD,
        help=f"the synthetic workload, sent at its own arrival times ({WORKLOAD})",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=DEFAULT_REQUESTS,
        help=f"requests of the workload ({DEFAULT_REQUESTS}; interleaved: a quarter stream)",
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds, each both then pd on fresh instances (2)"
    )
    add_overrides(parser, "model.preset=small")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds each side's load may run (300)"
    )
    parser.add_argument(
        "--plot", type=Path, metavar="FILE", help="the PNG (next to --json, else bench-pd.png)"
    )


def _check(args: argparse.Namespace) -> None:
    """ValueError naming the option that is wrong."""
    from ringfence.sched.synthetic import SYNTHETIC

    if args.workload not in SYNTHETIC:
        raise ValueError(f"--workload: unknown {args.workload!r}; known: {', '.join(SYNTHETIC)}")
    for flag, value in (("--requests", args.requests), ("--rounds", args.rounds)):
        if value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    roles = [s for s in args.overrides if s.split("=", 1)[0].strip() == "engine.role"]
    if roles:
        raise ValueError(f"--set {roles[0]}: each side sets engine.role itself")


def _load(url: str, requests: Sequence[LoadRequest], timeout: float) -> dict[str, Any]:
    """The requests against the server at ``url``: their timelines and when they began."""
    from ringfence.actors.tools.bench.serving.client import run_load, served_model

    model = served_model(url, timeout=timeout)
    timelines, start = run_load(url, requests, model=model, timeout=timeout)
    return {"timelines": timelines, "start": start}


def started_together(stack: contextlib.ExitStack, makers: Sequence[Callable[[], _T]]) -> list[_T]:
    """Start servers at once (each ``maker`` blocks until its server is ready), each entered
    in ``stack``; the first maker's error is raised once every started one is in ``stack``."""
    with ThreadPoolExecutor(len(makers)) as pool:
        futures = [pool.submit(make) for make in makers]
    errors = [e for f in futures if (e := f.exception()) is not None]
    servers = [f.result() for f in futures if f.exception() is None]
    for server in servers:
        stack.enter_context(server)  # type: ignore[arg-type]
    if errors:
        raise errors[0]
    return servers


def both_side(
    requests: Sequence[LoadRequest], settings: Sequence[str], folder: Path, timeout: float
) -> dict[str, Any]:
    """The requests against one fresh ``both`` instance: the timelines, the names left."""
    from ringfence.actors.tools.bench.serving.server import Served

    tier = f"cache.storage.path={folder / 'both-tier'}"
    sets = [*settings, "engine.role=both", "cache.storage.backend=local", tier]
    with Served(folder / "both", sets, start_timeout=START_S) as server:
        found = _load(server.url, requests, timeout)
        found["leaked_names"] = server.stop(deadline_s=STOP_S)
    return found


def pd_side(
    requests: Sequence[LoadRequest], settings: Sequence[str], folder: Path, timeout: float
) -> dict[str, Any]:
    """The requests through a router over a fresh prefill and decode instance pair: the
    timelines, the names left, and the hand-over's figures from their logs."""
    from ringfence.actors.tools.bench.serving.handover import read_handover, router_lines
    from ringfence.actors.tools.bench.serving.server import Routed, Served

    threads = f"actors.worker.threads={pd_threads()}"  # before --set: a --set of it wins
    tier = f"cache.storage.path={folder / 'tier'}"
    shared = [threads, *settings, "cache.storage.backend=local", tier]
    prefill_sets = [*shared, "engine.role=prefill"]
    decode_sets = [*shared, "engine.role=decode", "sched.preemption=save"]
    with contextlib.ExitStack() as stack:
        prefill, decode = started_together(
            stack,
            [
                lambda: Served(folder / "prefill", prefill_sets, start_timeout=START_S),
                lambda: Served(folder / "decode", decode_sets, start_timeout=START_S),
            ],
        )
        with Routed(folder, [prefill.url], [decode.url], start_timeout=START_S) as router:
            found = _load(router.url, requests, timeout)
            router.stop(deadline_s=STOP_S)
        found["leaked_names"] = prefill.stop(deadline_s=STOP_S) + decode.stop(deadline_s=STOP_S)
    routed = router_lines(router.log_path)
    found["handover"] = read_handover(prefill.run_dir, decode.run_dir, routed)
    return found


def pd_threads() -> int:
    """Threads of each of the pd side's two Workers: half the machine's CPUs."""
    return max(1, (os.cpu_count() or 1) // 2)


SIDES = {"both": both_side, "pd": pd_side}


def bench(
    requests: Sequence[LoadRequest], *, settings: Sequence[str], rounds: int, timeout: float
) -> list[dict[str, dict[str, Any]]]:
    """``rounds`` rounds, each side in turn on fresh instances: per round and side, the
    timelines, their start, the names left, and (pd) the hand-over's figures."""
    found: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rf-bench-pd-") as tmp:
        for index in range(rounds):
            sides: dict[str, Any] = {}
            for name, side in SIDES.items():
                folder = Path(tmp) / f"round-{index}" / name
                folder.mkdir(parents=True)
                sides[name] = side(requests, settings, folder, timeout)
            found.append(sides)
    return found


def main(args: argparse.Namespace) -> int:
    _check(args)
    settings = [*DEFAULT_SETTINGS, *args.overrides]
    requests = load_requests(args.workload, args.requests, None, seed=0)
    start = time.perf_counter()
    try:
        rounds = bench(requests, settings=settings, rounds=args.rounds, timeout=args.timeout)
    except RunError as e:
        print(f"ringfence bench pd: {e}", file=sys.stderr)
        return 1
    result: dict[str, Any] = {
        **environment(),
        "settings": settings,
        "workload": args.workload,
        "requests": len(requests),
        "pd_worker_threads": pd_threads(),
        **pd_report.figures(requests, rounds),
        "wall_s": round(time.perf_counter() - start, 3),
    }
    print(pd_report.table(result))
    plot = plot_path(args, "bench-pd.png")
    pd_report.plot(plot, result)
    result["plot"] = str(plot)
    if args.json is not None:
        Path(args.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    failures = pd_report.failures(result)
    for failure in failures:
        print(f"ringfence bench pd: {failure}", file=sys.stderr)
    return 1 if failures else 0

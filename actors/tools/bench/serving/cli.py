"""``ringfence bench serve``: load over HTTP against ``ringfence serve``, beside the same
requests through ``ringfence launch``, in the style of vLLM's ``benchmark_serving.py``.

For each workload (``synthetic:chat``, the long multi-round chat, and ``synthetic:unique``,
prompts that share nothing) and each request rate, the workload's first ``--requests``
requests get arrival times from a seeded Poisson process of that rate (``inf``: all at
once), keeping their order, prompt token ids, max_tokens and seeds. Then, each on a fresh
instance (so the cache starts cold for both) and on the same ``--set`` overrides:

* serve: ``ringfence serve`` on a free port; one ``httpx.AsyncClient`` streams each request
  from ``/v1/completions`` at its arrival time (:mod:`.client`); the server is stopped
  by SIGINT;
* launch: the same requests as a JSON-lines workload file, ``ringfence launch --workload
  FILE`` (its arrivals honoured); its ``summary.json`` and ``outputs.jsonl`` are read.

Reported per (workload, rate) and side: TTFT, TPOT and ITL p50/p99 (a launch has no
per-token times, so no ITL; its TTFT counts from the request's arrival time in the
engine, the client's from when it sent the request), request and output-token
throughput over the busy period, and the serve/launch ratios of TTFT p50 (above 1:
serving's first tokens come later) and of output-token throughput (below 1: serving is
slower), with the share of requests whose output tokens are the same on both sides,
and the front end's CPU over the load. With ``--security``, the serve side again with an
API key and with a key over HTTPS, each on a fresh server, beside the plain one
(:mod:`.security`: TTFT p50 and p90 and throughput against it). Last, the front end's own
CPU at ``--burst`` streams at once (short unique prompts) on a fresh server: the CPU clock
of the front end process read before and after, CPU seconds per second and per output
token.

A server or launch that fails to start or exit, or a request that fails, is an error
(exit status 1) after the table, JSON and plot are written.
"""

from __future__ import annotations

import argparse
import math
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from ringfence.actors.engine.percentiles import percentile
from ringfence.actors.tools.bench import launcher
from ringfence.actors.tools.bench.launcher import RunError
from ringfence.actors.tools.bench.options import add_overrides, environment, plot_path
from ringfence.actors.tools.bench.serving import report, security
from ringfence.actors.tools.bench.serving.client import LoadRequest
from ringfence.actors.tools.bench.serving.security import Security
from ringfence.actors.tools.bench.serving.stats import parse_rate, poisson_arrivals, rate_label
from ringfence.sched.sampling import MAX_LOGPROBS

WORKLOADS = ("chat", "unique")
DEFAULT_SETTINGS = ("model.preset=small",)  # the main job's; --set comes after and wins
DEFAULT_RATES = "1,inf"
DEFAULT_REQUESTS = 8  # chat: 2 users, 4 rounds each
BURST_STREAMS = 64
BURST_TOKENS = 32
# The burst's prompts: the first tokens of unique's (each its own head), short so that the
# streams spend the burst streaming, which is the front end's work, not waiting for prefill.
BURST_PROMPT_TOKENS = 32
START_S = 180.0  # a server's start-up (four processes importing torch, the model built)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument(
        "--rates",
        default=DEFAULT_RATES,
        help=f"request rates per second, comma-separated; inf = all at once ({DEFAULT_RATES})",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=DEFAULT_REQUESTS,
        help=f"requests of each workload ({DEFAULT_REQUESTS}; chat: 4 per user)",
    )
    parser.add_argument(
        "--workloads",
        default=",".join(WORKLOADS),
        help=f"synthetic workloads, comma-separated ({','.join(WORKLOADS)})",
    )
    add_overrides(parser, "model.preset=small")
    parser.add_argument("--seed", type=int, default=0, help="seed of the arrival times (0)")
    parser.add_argument(
        "--burst",
        type=int,
        default=BURST_STREAMS,
        help=f"concurrent streams of the front end's CPU burst; 0 = no burst ({BURST_STREAMS})",
    )
    parser.add_argument(
        "--burst-tokens",
        type=int,
        default=BURST_TOKENS,
        help=f"max_tokens of each burst stream ({BURST_TOKENS})",
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        metavar="K",
        help="every request asks for the top K log probabilities of each output token, "
        "on both sides (none by default): the cost of computing them",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds each server or launch may run (300)"
    )
    parser.add_argument(
        "--plot", type=Path, metavar="FILE", help="the PNG (next to --json, else bench-serve.png)"
    )
    security.add_arguments(parser)


def _check(args: argparse.Namespace) -> tuple[list[float], list[str]]:
    """The rates and workloads; ValueError naming the option that is wrong."""
    from ringfence.sched.synthetic import SYNTHETIC

    rates = [parse_rate(part.strip()) for part in args.rates.split(",") if part.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for flag, given in (("--rates", [rate_label(r) for r in rates]), ("--workloads", workloads)):
        if not given:
            raise ValueError(f"{flag}: none given")
        twice = sorted({g for g in given if given.count(g) > 1})
        if twice:
            raise ValueError(f"{flag}: {', '.join(twice)} given twice")
    unknown = [w for w in workloads if w not in SYNTHETIC]
    if unknown:
        raise ValueError(f"--workloads: unknown {unknown}; known: {', '.join(SYNTHETIC)}")
    for flag, value, least in (
        ("--requests", args.requests, 1),
        ("--burst", args.burst, 0),
        ("--burst-tokens", args.burst_tokens, 1),
        ("--seed", args.seed, 0),
        ("--logprobs", 0 if args.logprobs is None else args.logprobs, 0),
    ):
        if value < least:
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    if args.logprobs is not None and args.logprobs > MAX_LOGPROBS:
        raise ValueError(f"--logprobs must be <= {MAX_LOGPROBS}, got {args.logprobs}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    return rates, workloads


def load_requests(
    workload: str, requests: int, rate: float | None, *, seed: int, logprobs: int | None = None
) -> list[LoadRequest]:
    """The synthetic workload's first ``requests`` requests, in their order, with Poisson
    arrival times of ``rate`` in place of their own (None: their own), each asking for
    ``logprobs`` top log probabilities per output token (None: none)."""
    from ringfence.sched.synthetic import synthetic

    lines = synthetic(workload, requests=requests)
    if rate is None:
        arrivals = [line.arrival_s for line in lines]
    else:
        arrivals = poisson_arrivals(rate, len(lines), seed=seed)
    return [
        LoadRequest(
            id=line.id,
            prompt_token_ids=tuple(line.prompt_token_ids or ()),
            max_tokens=line.params.max_tokens,
            arrival_s=arrival,
            temperature=line.params.temperature,
            seed=line.params.seed,
            session=line.session,
            logprobs=logprobs,
        )
        for line, arrival in zip(lines, arrivals, strict=True)
    ]


def workload_file(requests: Sequence[LoadRequest]) -> bytes:
    """The requests as ``ringfence launch``'s JSON-lines workload (sched/workload.py)."""
    lines = []
    for r in requests:
        line: dict[str, Any] = {
            "id": r.id,
            "prompt_token_ids": list(r.prompt_token_ids),
            "max_tokens": r.max_tokens,
            "temperature": r.temperature,
            "seed": r.seed,
            "arrival_s": r.arrival_s,
        }
        if r.session:
            line["session"] = r.session
        if r.logprobs is not None:
            line["logprobs"] = r.logprobs
        lines.append(orjson.dumps(line))
    return b"\n".join(lines) + b"\n"


def serve_side(
    requests: Sequence[LoadRequest],
    settings: Sequence[str],
    run_dir: Path,
    timeout: float,
    guard: Security | None = None,
) -> dict[str, Any]:
    """The requests against a fresh ``ringfence serve`` in ``run_dir`` (with ``guard``'s key
    and TLS files, if given): the figures of :func:`stats.summarize` and the TTFT's p90
    (``ttft_p90_s``), the front end's CPU seconds over the load (from just before
    the first request to just after the last stream ended: ``frontend_cpu_s``, per second
    and per output token), the served model's name, the output tokens by request, and the
    names the server's stop left behind (unlinked)."""
    import httpx

    from ringfence.actors.tools.bench.serving.client import run_load, served_model
    from ringfence.actors.tools.bench.serving.server import Served
    from ringfence.actors.tools.bench.serving.stats import busy_period, summarize

    env: dict[str, str] | None = None
    client: dict[str, Any] = {}  # the load's headers and certificate check
    if guard is not None:
        settings = [*settings, *guard.settings()]
        env, client = guard.env(), {"headers": guard.headers(), "verify": guard.verify()}
    with Served(run_dir, settings, start_timeout=START_S, env=env) as server:
        try:
            model = served_model(server.url, timeout=timeout, **client)
        except (httpx.HTTPError, ValueError) as e:
            raise RunError(f"ringfence serve: GET /v1/models failed: {e}\n{server.tail()}") from e
        cpu_before, wall_before = server.frontend_cpu_s(), time.perf_counter()
        timelines, start = run_load(server.url, requests, model=model, timeout=timeout, **client)
        cpu_after, wall_after = server.frontend_cpu_s(), time.perf_counter()
        leaked = server.stop(deadline_s=timeout)
    figures = summarize(timelines, duration_s=busy_period(timelines, start_s=start))
    cpu_s, wall_s = cpu_after - cpu_before, wall_after - wall_before
    tokens = figures["output_tokens"]
    ttfts = [v for t in timelines if not t.error and (v := t.ttft_s) is not None]
    return {
        **figures,
        "ttft_p90_s": percentile(ttfts, 90) if ttfts else None,
        "frontend_cpu_s": cpu_s,
        "wall_s": wall_s,
        "frontend_cpu_s_per_s": cpu_s / wall_s if wall_s > 0 else None,
        "frontend_cpu_s_per_token": cpu_s / tokens if tokens else None,
        "model": model,
        "leaked_names": leaked,
        "tokens": {t.id: list(t.token_ids) for t in timelines},
    }


def launch_side(
    requests: Sequence[LoadRequest], settings: Sequence[str], folder: Path, timeout: float
) -> dict[str, Any]:
    """The same requests through ``ringfence launch --workload FILE``: its figures in
    :func:`serve_side`'s shape (no ITL), and its output tokens by request."""
    path = folder / "workload.jsonl"
    path.write_bytes(workload_file(requests))
    done = launcher.run(
        folder / "launch",
        [*settings, "engine.progress=false"],
        what="launch",
        timeout=timeout,
        workload=str(path),
        needs_summary=True,
    )
    return report.launched(done.summary, done.outputs)


def burst(
    settings: Sequence[str], streams: int, tokens: int, folder: Path, timeout: float
) -> dict[str, Any]:
    """``streams`` unique prompts of BURST_PROMPT_TOKENS tokens streamed at once from a
    fresh server (max_tokens ``tokens``): :func:`serve_side`'s figures, the front end's
    CPU among them, without the tokens."""

    requests = [
        LoadRequest(
            id=r.id,
            prompt_token_ids=r.prompt_token_ids[:BURST_PROMPT_TOKENS],
            max_tokens=tokens,
            arrival_s=0.0,
            seed=r.seed,
        )
        for r in load_requests("unique", streams, math.inf, seed=0)
    ]
    found = serve_side(requests, settings, folder / "burst", timeout)
    del found["tokens"]
    return {**found, "streams": streams, "max_tokens": tokens}


def bench(
    workloads: Sequence[str],
    rates: Sequence[float],
    *,
    requests: int,
    settings: Sequence[str],
    seed: int,
    burst_streams: int,
    burst_tokens: int,
    timeout: float,
    logprobs: int | None = None,
    guards: Sequence[Security] = (),
) -> dict[str, Any]:
    """Every (workload, rate) pair, serve then launch (then serve with each of ``guards``),
    each on a fresh instance; then the burst. The report's ``rows`` and ``burst`` (None
    without one)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="rf-bench-serve-") as tmp:
        for workload in workloads:
            for rate in rates:
                folder = Path(tmp) / f"{workload}-{rate_label(rate)}"
                folder.mkdir()
                load = load_requests(workload, requests, rate, seed=seed, logprobs=logprobs)
                served = serve_side(load, settings, folder / "serve", timeout)
                launched = launch_side(load, settings, folder, timeout)
                row = report.row(workload, rate, served, launched)
                for guard in guards:
                    run_dir = folder / f"serve-{guard.mode}"
                    guarded = serve_side(load, settings, run_dir, timeout, guard)
                    del guarded["tokens"]
                    ratios = security.compare(served, guarded)
                    row.setdefault("security", {})[guard.mode] = {
                        "figures": guarded,
                        "ratios": ratios,
                    }
                rows.append(row)
                shutil.rmtree(folder, ignore_errors=True)  # its storage tier: up to 250 MB
        found = None
        if burst_streams:
            folder = Path(tmp) / "burst"
            folder.mkdir()
            found = burst(settings, burst_streams, burst_tokens, folder, timeout)
    return {"rows": rows, "burst": found}


def main(args: argparse.Namespace) -> int:
    rates, workloads = _check(args)
    guards = security.modes(args)
    settings = [*DEFAULT_SETTINGS, *args.overrides]
    start = time.perf_counter()
    try:
        figures = bench(
            workloads,
            rates,
            requests=args.requests,
            settings=settings,
            seed=args.seed,
            burst_streams=args.burst,
            burst_tokens=args.burst_tokens,
            timeout=args.timeout,
            logprobs=args.logprobs,
            guards=guards,
        )
    except RunError as e:
        print(f"ringfence bench serve: {e}", file=sys.stderr)
        return 1
    result: dict[str, Any] = {
        **environment(),
        "settings": settings,
        "requests": args.requests,
        "rates": [rate_label(r) for r in rates],
        "seed": args.seed,
        "logprobs": args.logprobs,
        "security": [g.mode for g in guards],
        **figures,
        "wall_s": round(time.perf_counter() - start, 3),
    }
    print(report.table(result))
    plot = plot_path(args, "bench-serve.png")
    report.plot(plot, result)
    result["plot"] = str(plot)
    if args.json is not None:
        Path(args.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    failures = report.failures(result)
    for failure in failures:
        print(f"ringfence bench serve: {failure}", file=sys.stderr)
    return 1 if failures else 0

"""``ringfence bench router-latency``: what the router adds to a request's latency, measured
on its own behind instances that answer at once (issue 36: under 2 ms at p99).

Each policy of ``--policies`` runs on ``--instances`` fresh stub instances
(:mod:`.stub_instance`: an aggregated instance's API with every answer ready at once, KV
events published unless ``--no-events``), each in a process of its own, behind a fresh
``ringfence router --instance ... --policy P`` (its own process, as a user runs it). Fresh
stubs for each policy: a ``cache`` router that started behind stubs that had served the
other policies would first replay every batch they published (seen here: its first cell
took twice the router CPU per request of the same cell on fresh stubs), and its index would
start full. Each cell (a policy, a ``--concurrency``, a prompt form of ``--prompts``, an
answer form of ``--answers``) sends ``--requests`` requests directly to the stubs (in turn) and the
same requests through the router, closed loop (:mod:`.latency_load`), after ``--warmup``
requests on each side; the sides alternate in ``--rounds`` rounds. Every cell has prompts
of its own (``--prompt-tokens`` each, three quarters one of ``--prefixes`` shared heads),
so the stubs publish new blocks in every cell and the ``cache`` policy's index grows as an
instance's would.

Prompt forms: ``ids`` (token ids: ``approximate`` and ``cache`` hash them as they are),
``text`` and ``chat`` (``approximate`` and ``cache`` first ask an instance's ``/tokenize``:
that call's cost is in those rows); ``round_robin`` and ``least_loaded`` read no prompt.

The report (:mod:`.latency_report`): per cell each side's p50/p90/p99, the router's added
latency (router minus direct, percentile by percentile), the target as PASS/FAIL (judged at
concurrency 1: the router on its own), the router's own ``total_s`` from its log, and the
router process's CPU time per request (its CPU clock around the cell, over the
requests it routed: the direct side costs it nothing, bar the events it follows); per
policy what its log says of the KV events (``router.no_events``), of the instances' load
(``router.no_load``: a router that cannot follow it), of the blocks the policy
found cached, and of the requests each instance got. The target is informational: the
exit status is 1 only for a failed request or a process that did not start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import orjson

from ringfence.actors.tools.bench.launcher import RunError
from ringfence.actors.tools.bench.options import environment
from ringfence.actors.tools.bench.serving import latency_report
from ringfence.actors.tools.bench.serving.latency_load import PATHS, PROMPTS, Shape

POLICIES: Final = ("round_robin", "least_loaded", "approximate", "cache")
ANSWERS: Final = ("json", "sse")
START_S: Final = 60.0  # a stub's or a router's start (a Python process importing its server)
STOP_S: Final = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help=f"comma-separated ({','.join(POLICIES)})"
    )
    parser.add_argument("--instances", type=int, default=3, help="stub instances (3)")
    parser.add_argument(
        "--concurrency", default="1,8", help="closed-loop concurrencies, comma-separated (1,8)"
    )
    parser.add_argument(
        "--prompts", default="ids,text", help=f"prompt forms ({','.join(PROMPTS)}; ids,text)"
    )
    parser.add_argument(
        "--answers", default="json,sse", help="answer forms: json, sse (streamed) (json,sse)"
    )
    parser.add_argument(
        "--requests", type=int, default=2000, help="measured requests a side and cell (2000)"
    )
    parser.add_argument(
        "--warmup", type=int, default=100, help="requests a side and cell before those (100)"
    )
    parser.add_argument("--rounds", type=int, default=10, help="rounds of both sides a cell (10)")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="tokens a prompt (512)")
    parser.add_argument("--prefixes", type=int, default=8, help="shared prompt heads a cell (8)")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens an answer (4)")
    parser.add_argument("--no-events", action="store_true", help="the stubs publish no KV events")


def _listed(flag: str, text: str, known: Sequence[str]) -> list[str]:
    """The comma-separated names of ``--flag``; ValueError naming it if one is unknown,
    given twice, or none is given."""
    given = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [g for g in given if g not in known]
    if unknown or not given or len(set(given)) != len(given):
        raise ValueError(f"--{flag}: got {given}; known: {', '.join(known)}, each once")
    return given


def check(args: argparse.Namespace) -> dict[str, Any]:
    """The run's plan from the command line; ValueError naming the option that is wrong."""
    try:
        concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--concurrency: {args.concurrency!r} is not integers") from None
    if not concurrency or min(concurrency) < 1:
        raise ValueError(f"--concurrency: each must be >= 1, got {args.concurrency!r}")
    for flag, least in (("instances", 1), ("requests", 1), ("warmup", 0), ("rounds", 1),
                        ("prompt_tokens", 1), ("prefixes", 1), ("max_tokens", 1)):  # fmt: skip
        if getattr(args, flag) < least:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= {least}")
    if args.rounds > args.requests:
        raise ValueError("--rounds must be <= --requests")
    answers = _listed("answers", args.answers, ANSWERS)
    return {
        "policies": _listed("policies", args.policies, POLICIES),
        "concurrency": concurrency,
        "shapes": [Shape(prompt=p, stream=a == "sse")
                   for p in _listed("prompts", args.prompts, PROMPTS) for a in answers],
    }  # fmt: skip


def bodies_of(shape: Shape, args: argparse.Namespace, seed: int) -> list[bytes]:
    """A cell's request bodies, warm-up first (its prompts drawn from ``seed``)."""
    from ringfence.actors.tools.bench.serving.latency_load import body_of, prompts

    drawn = prompts(args.warmup + args.requests, prompt_tokens=args.prompt_tokens,
                    prefixes=args.prefixes, seed=seed)  # fmt: skip
    return [body_of(ids, shape, max_tokens=args.max_tokens) for ids in drawn]


def policy_runs(
    policy: str, *, number: int, stubs: Sequence[str], plan: dict[str, Any],
    args: argparse.Namespace, folder: Path,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """Every cell of ``policy`` (the ``number``-th) through a fresh router over ``stubs``:
    the report's rows, and what the router's log says of the policy."""
    from ringfence.actors.tools.bench.serving.handover import router_lines
    from ringfence.actors.tools.bench.serving.latency_load import measure
    from ringfence.actors.tools.bench.serving.server import Routed, cpu_seconds

    options = ["--policy", policy, *(arg for url in stubs for arg in ("--instance", url))]
    cells = [(c, shape) for c in plan["concurrency"] for shape in plan["shapes"]]
    found = []
    with Routed(folder / policy, [], [], start_timeout=START_S, options=options) as router:
        for index, (concurrency, shape) in enumerate(cells):
            bodies = bodies_of(shape, args, seed=number * len(cells) + index)
            before = cpu_seconds(router.pid)
            sides = asyncio.run(measure(
                stubs, router.url, PATHS[shape.prompt], bodies, warmup=args.warmup,
                rounds=args.rounds, concurrency=concurrency, stream=shape.stream,
            ))  # fmt: skip
            cpu = (cpu_seconds(router.pid) - before) / len(bodies)
            found.append((concurrency, shape, sides, cpu))
        router.stop(deadline_s=STOP_S)
    lines = router_lines(router.log_path)
    routed = [line for line in lines if line["event"] == "router.routed"]
    per_cell = args.warmup + args.requests
    whole = len(routed) == per_cell * len(cells)  # else the lines cannot be told apart
    rows = []
    for index, (concurrency, shape, sides, cpu) in enumerate(found):
        mine = routed[index * per_cell + args.warmup : (index + 1) * per_cell] if whole else []
        rows.append(latency_report.row(
            policy=policy, concurrency=concurrency, prompt=shape.prompt, stream=shape.stream,
            sides=sides, routed_total_s=[float(line["total_s"]) for line in mine],
            router_cpu_s=cpu,
        ))  # fmt: skip
    names = {url: f"i{n}" for n, url in enumerate(stubs)}
    cached = [line for line in routed if (line.get("cached_blocks") or 0) > 0]
    about = {
        "routed": len(routed),
        "no_events": sum(line["event"] == "router.no_events" for line in lines),
        "no_load": sum(line["event"] == "router.no_load" for line in lines),
        "with_cached_blocks": len(cached),
        "per_instance": dict(Counter(names.get(line["instance"], "?") for line in routed)),
    }
    return rows, about


def bench(plan: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Each policy in turn on fresh stubs behind a fresh router; the report's rows and
    policies."""
    from ringfence.actors.tools.bench.serving.pd import started_together
    from ringfence.actors.tools.bench.serving.stub_instance import Stub

    rows: list[dict[str, Any]] = []
    policies: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rf-bench-router-latency-") as tmp:
        for number, policy in enumerate(plan["policies"]):
            folder = Path(tmp) / policy
            with contextlib.ExitStack() as stack:
                stubs = started_together(stack, [
                    lambda n=n, f=folder: Stub(f / f"stub-{n}.out", events=not args.no_events,  # type: ignore[misc]
                                               start_timeout=START_S)
                    for n in range(args.instances)
                ])  # fmt: skip
                found, about = policy_runs(
                    policy, number=number, stubs=[stub.url for stub in stubs], plan=plan,
                    args=args, folder=folder,
                )  # fmt: skip
            rows += found
            policies[policy] = about
    return {"rows": rows, "policies": policies}


def main(args: argparse.Namespace) -> int:
    plan = check(args)
    began = time.perf_counter()
    try:
        found = bench(plan, args)
    except RunError as e:
        print(f"ringfence bench router-latency: {e}", file=sys.stderr)
        return 1
    result: dict[str, Any] = {
        **environment(),
        "instances": args.instances,
        "requests": args.requests,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "prompt_tokens": args.prompt_tokens,
        "prefixes": args.prefixes,
        "max_tokens": args.max_tokens,
        "events": not args.no_events,
        **found,
        "target": latency_report.verdict(found["rows"]),
        "wall_s": round(time.perf_counter() - began, 3),
    }
    print(latency_report.table(result))
    for policy, about in result["policies"].items():
        spread = ", ".join(f"{k} {v}" for k, v in sorted(about["per_instance"].items()))
        events = "events not read"
        if policy == "cache":
            events = "no events (router.no_events)" if about["no_events"] else "events followed"
        print(f"  {policy}: {about['routed']} routed ({spread}); {events}; "
              f"{about['with_cached_blocks']} found cached blocks")  # fmt: skip
    if args.json is not None:
        Path(args.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    failed = sum(r[side]["failed"] for r in result["rows"] for side in ("direct", "router"))
    if failed:
        print(f"ringfence bench router-latency: {failed} requests failed", file=sys.stderr)
    return 1 if failed else 0

"""``ringfence bench route``: the router's policies side by side on a shared-prefix workload.

The workload is what cache-aware routing is for: ``--groups`` groups of users, each group
behind its own long system prompt (``--system-blocks`` blocks), each of its ``--users``
users returning for ``--turns`` turns, every turn's prompt the system prompt, the whole
conversation so far (the earlier messages and stand-in answers) and a new message; all
turns of one index arrive before the next index's, at Poisson times of ``--rate``
requests per second. Greedy, so every policy must give every request the same tokens.

``--case`` names a workload: ``light`` (the default: 4 groups behind 12-block system
prompts, 3 users, 3 turns, 2 requests a second), ``saturation`` (6 groups behind 24-block
prompts, 3 users, 3 turns, 6 a second: the instances' queues grow) and ``flood`` (one hot
24-block prompt shared by 16 users, 2 turns, 8 a second: a cache-aware router that sends
every request where the prefix is queues them all on one instance unless it spills). Each
workload option given overrides the case's.

With ``--direct N``, the first ``N`` users of each group are another client's: they send
straight to one instance (group ``g``'s to instance ``g mod instances``), never through the
router. What they leave cached there only the instances' KV events tell the router; the
``approximate`` policy, which remembers only where it sent prompts, cannot know it.

Each policy runs on ``--instances`` fresh ``ringfence serve`` instances (KV events on,
each Worker with an equal share of the CPUs) behind a fresh ``ringfence router
--instance ... --policy P``; the policies take turns round by round. The report, per
policy (the median over rounds): TTFT p50/p90/p99, ITL p50/p99, output tokens per second,
the share of prompt tokens each tier served (the instances' own ``usage``), the requests
each instance got (the router's ``router.routed`` lines), and whether every request's
tokens equal the first policy's; then ``cache`` against ``round_robin`` and against
``approximate`` as ratios (TTFT p90, throughput). JSON, and a PNG of the ratios.

With ``--sim``, each instance is a simulated one (``sim_instance.py``: no model, a modelled
engine with a prefix cache and step times) instead of a ``ringfence serve``: on a machine
whose few cores the instances share, spreading requests over real instances is not
spreading work, and the policies cannot be told apart. The report and JSON then say
``"instances_kind": "sim"`` and give the cost model. Its default (:data:`SIM_MODEL`) is the
simulated instance's own 1B-class scale with every time ten times longer (a 40 ms step,
0.5 ms a prompt token, 0.5 ms a decoding sequence): a uniform scale of time changes no ratio
between policies, and at the longer steps the router, the load client and the simulated
instances, which share the CPUs, cost a few percent of a step instead of most of one.
``--sim-set KEY=VALUE`` changes one field (``blocks=256``, ``step_ms=4``).

Each case has a rate for the simulated instances (``sim_rate``), set on that model with
the bench's own workload and three instances under round robin (each step modelled as the
instance does it, no HTTP): ``light`` at 2 a second leaves each instance idle (no step
running) more than half the time, and a request seldom finds another's prefill before its
own; ``saturation`` at 30 a second brings more uncached prefill than three instances
compute (the mean TTFT of the last third of the requests is still about five steps, 0.55 s,
against 0.1 s at 10 a second); ``flood`` at 60 a second is a hot prefix that one instance
holding it cannot keep up with (every request sent to it: TTFT p50 0.3 s and growing with
the rate, against 0.13 s spread over three). ``--rate`` overrides it as it does the case's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from statistics import median
from typing import Any

import orjson

from ringfence.actors.engine.percentiles import percentile
from ringfence.actors.tools.bench.launcher import RunError
from ringfence.actors.tools.bench.options import add_overrides, environment, plot_path
from ringfence.actors.tools.bench.serving.client import LoadRequest
from ringfence.actors.tools.bench.serving.pd import START_S, STOP_S, started_together
from ringfence.actors.tools.bench.serving.sim_engine import CostModel
from ringfence.actors.tools.bench.serving.stats import Timeline, poisson_arrivals

POLICIES = ("round_robin", "least_loaded", "approximate", "cache")
WORKLOAD = ("groups", "users", "turns", "system_blocks", "rate")
# The named workloads (see the module docstring): the values of WORKLOAD's options, and
# the rate on simulated instances (--sim) instead of ``rate``.
CASES: dict[str, dict[str, float]] = {
    "light": {"groups": 4, "users": 3, "turns": 3, "system_blocks": 12, "rate": 2.0,
              "sim_rate": 2.0},
    "saturation": {"groups": 6, "users": 3, "turns": 3, "system_blocks": 24, "rate": 6.0,
                   "sim_rate": 30.0},
    "flood": {"groups": 1, "users": 16, "turns": 2, "system_blocks": 24, "rate": 8.0,
              "sim_rate": 60.0},
}  # fmt: skip
SIM_TIME_SCALE = 10.0  # --sim: the simulated instance's default times, this many times longer
_SCALED = CostModel()
SIM_MODEL = CostModel(
    step_ms=_SCALED.step_ms * SIM_TIME_SCALE,
    prefill_ms_per_token=_SCALED.prefill_ms_per_token * SIM_TIME_SCALE,
    decode_ms_per_seq=_SCALED.decode_ms_per_seq * SIM_TIME_SCALE,
)
DEFAULT_SETTINGS = ("model.preset=small", "events.enabled=true")
BLOCK = 16  # tokens a block: cache.block_size's default
VOCAB = 250  # token ids drawn from 1..VOCAB (inside every preset's vocabulary)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument("--instances", type=int, default=3, help="instances behind the router (3)")
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help=f"comma-separated ({','.join(POLICIES)})"
    )
    parser.add_argument(
        "--case", choices=sorted(CASES), default="light",
        help="the workload: light, saturation or flood (light; see the options below)",
    )  # fmt: skip
    parser.add_argument("--groups", type=int, help="system prompts (the case's; light: 4)")
    parser.add_argument("--users", type=int, help="users per group (the case's; light: 3)")
    parser.add_argument("--turns", type=int, help="turns per user (the case's; light: 3)")
    parser.add_argument(
        "--system-blocks", type=int, help="blocks of each system prompt (the case's; light: 12)"
    )
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens a turn (16)")
    parser.add_argument("--rate", type=float, help="requests per second (the case's; light: 2)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every policy (1)")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds one policy's load may run (600)"
    )
    parser.add_argument(
        "--direct",
        type=int,
        default=0,
        help="users of each group who bypass the router, to one instance (0)",
    )
    parser.add_argument(
        "--overlap-weight", type=float, default=None,
        help="the routers' --overlap-weight (default: the router's, 4)",
    )  # fmt: skip
    parser.add_argument("--plot", type=Path, metavar="FILE", help="the PNG (bench-route.png)")
    parser.add_argument(
        "--sim", action="store_true",
        help="simulated instances (sim_instance.py) instead of ringfence serve, at the case's "
        "sim rate",
    )  # fmt: skip
    parser.add_argument(
        "--sim-set", action="append", default=[], metavar="KEY=VALUE",
        help="a field of the simulated instances' cost model (repeatable; step_ms, "
        "prefill_ms_per_token, decode_ms_per_seq, blocks, max_batched_tokens, max_num_seqs)",
    )  # fmt: skip
    add_overrides(parser, ",".join(DEFAULT_SETTINGS))


def sim_model(sets: Sequence[str]) -> CostModel:
    """:data:`SIM_MODEL` with each ``KEY=VALUE`` of ``--sim-set`` applied; ValueError naming
    a malformed one or an unknown key."""
    values: dict[str, float | int] = SIM_MODEL.as_dict()
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep or key not in values:
            raise ValueError(f"--sim-set {item!r}: KEY=VALUE with KEY one of {', '.join(values)}")
        kind = type(values[key])
        try:
            values[key] = kind(text)
        except ValueError:
            raise ValueError(f"--sim-set {item!r}: {text!r} is not {kind.__name__}") from None
    return CostModel(**values)  # type: ignore[arg-type]


def shared_prefix_requests(
    *, groups: int, users: int, turns: int, system_blocks: int, max_tokens: int,
    rate: float, seed: int = 0,
) -> list[LoadRequest]:  # fmt: skip
    """The workload (see the module docstring), in arrival order."""
    rng = random.Random(f"ringfence.bench.route:{seed}")
    systems = [[rng.randint(1, VOCAB) for _ in range(system_blocks * BLOCK)] for _ in range(groups)]
    order: list[tuple[int, int, int]] = []
    for turn in range(turns):
        this_turn = [(turn, g, u) for g in range(groups) for u in range(users)]
        rng.shuffle(this_turn)
        order += this_turn
    history: dict[tuple[int, int], list[int]] = {}
    arrivals = poisson_arrivals(rate, len(order), seed=seed)
    requests = []
    for (turn, g, u), arrival in zip(order, arrivals, strict=True):
        said = history.setdefault((g, u), list(systems[g]))
        said += [rng.randint(1, VOCAB) for _ in range(BLOCK)]  # the user's new message
        requests.append(
            LoadRequest(id=f"g{g}-u{u}-t{turn}", prompt_token_ids=tuple(said),
                        max_tokens=max_tokens, arrival_s=arrival, session=f"g{g}-u{u}")
        )  # fmt: skip
        said += [rng.randint(1, VOCAB) for _ in range(BLOCK)]  # a stand-in for its answer
    return requests


def direct_instance(request: LoadRequest, direct: int, count: int) -> int | None:
    """The instance a request of ``--direct``'s users goes to straight (None: the router)."""
    group, user = (int(part[1:]) for part in request.session.split("-"))
    return group % count if user < direct else None


def policy_side(
    policy: str, requests: Sequence[LoadRequest], *, settings: Sequence[str], count: int,
    folder: Path, timeout: float, router_options: Sequence[str] = (), direct: int = 0,
    sim: CostModel | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The requests through a router with ``policy`` over ``count`` fresh instances (those
    of ``direct`` users straight to their instance): ``ringfence serve`` on ``settings``, or
    simulated instances of ``sim``."""
    from ringfence.actors.tools.bench.serving.client import run_load_async, served_model
    from ringfence.actors.tools.bench.serving.handover import router_lines
    from ringfence.actors.tools.bench.serving.server import Routed, Served, Started
    from ringfence.actors.tools.bench.serving.sim_instance import Sim

    threads = f"actors.worker.threads={max(1, (os.cpu_count() or 1) // count)}"
    sets = [threads, *settings]

    def launch(n: int) -> Started:
        if sim is not None:
            return Sim(folder / f"i{n}.out", sim, start_timeout=START_S)
        return Served(folder / f"i{n}", sets, start_timeout=START_S)

    with contextlib.ExitStack() as stack:
        instances = started_together(
            stack,
            [lambda n=n: launch(n) for n in range(count)],  # type: ignore[misc]
        )
        options = ["--policy", policy, *router_options]
        for instance in instances:
            options += ["--instance", instance.url]
        with Routed(folder, [], [], start_timeout=START_S, options=options) as router:
            model = served_model(router.url, timeout=timeout)
            targets: dict[str, list[LoadRequest]] = {}
            for request in requests:
                n = direct_instance(request, direct, count)
                targets.setdefault(router.url if n is None else instances[n].url, []).append(
                    request
                )

            async def load() -> list[tuple[list[Timeline], float]]:
                return await asyncio.gather(*(
                    run_load_async(url, part, model=model, timeout=timeout)
                    for url, part in targets.items()
                ))  # fmt: skip

            loads = asyncio.run(load())
            by_id = {t.id: t for timelines, _ in loads for t in timelines}
            timelines = [by_id[r.id] for r in requests]
            start = min(begun for _, begun in loads)
            router.stop(deadline_s=STOP_S)
        names = {i.url: f"i{n}" for n, i in enumerate(instances)}
        leaked = [name for i in instances for name in i.stop(deadline_s=STOP_S)]
    routed = [line for line in router_lines(router.log_path) if line["event"] == "router.routed"]
    return {
        "timelines": timelines,
        "start": start,
        "leaked_names": leaked,
        "per_instance": dict(Counter(names.get(line["instance"], "?") for line in routed)),
    }


def figures(timelines: Sequence[Timeline], found: dict[str, Any]) -> dict[str, Any]:
    """One policy's figures of one round."""
    done = [t for t in timelines if not t.error]
    ttft = [v for t in done if (v := t.ttft_s) is not None]
    itl = [gap for t in done for gap in t.itl_s]
    span = max((t.end_s for t in done), default=0.0) - min((t.sent_s for t in done), default=0.0)
    cached: Counter[str] = Counter()
    prompt = 0
    for t in done:
        usage = t.usage or {}
        prompt += int(usage.get("prompt_tokens") or 0)
        cached.update((usage.get("ringfence") or {}).get("cached_tokens") or {})
    return {
        "failed": len(timelines) - len(done),
        "ttft_p50_s": percentile(ttft, 50) if ttft else None,
        "ttft_p90_s": percentile(ttft, 90) if ttft else None,
        "ttft_p99_s": percentile(ttft, 99) if ttft else None,
        "itl_p50_s": percentile(itl, 50) if itl else None,
        "itl_p99_s": percentile(itl, 99) if itl else None,
        "output_tokens_per_s": sum(t.output_tokens for t in done) / span if span > 0 else None,
        "cached_share": {tier: n / prompt for tier, n in sorted(cached.items())} if prompt else {},
        "per_instance": found["per_instance"],
        "leaked_names": found["leaked_names"],
    }


def _median(rounds: Sequence[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rounds if r[key] is not None]
    return median(values) if values else None


def report(policies: Sequence[str], rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    keys = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s",
            "output_tokens_per_s")  # fmt: skip
    by_policy: dict[str, Any] = {}
    for policy in policies:
        each = [r[policy]["figures"] for r in rounds]
        by_policy[policy] = {k: _median(each, k) for k in keys} | {
            "failed": sum(f["failed"] for f in each),
            "cached_share": each[-1]["cached_share"],
            "per_instance": each[-1]["per_instance"],
            "same_tokens": all(r[policy]["same_tokens"] for r in rounds),
            "leaked_names": [n for f in each for n in f["leaked_names"]],
        }
    ratios: dict[str, float | None] = {}
    spread: dict[str, list[float | None]] = {}  # each round's ratio: how far they agree
    if "cache" in by_policy:
        for other in ("round_robin", "approximate"):
            if other in by_policy:
                mine, theirs = by_policy["cache"], by_policy[other]
                ratios[f"ttft_p90 {other}/cache"] = _ratio(theirs["ttft_p90_s"], mine["ttft_p90_s"])
                ratios[f"throughput cache/{other}"] = _ratio(
                    mine["output_tokens_per_s"], theirs["output_tokens_per_s"]
                )
                each = [(r[other]["figures"], r["cache"]["figures"]) for r in rounds]
                spread[f"ttft_p90 {other}/cache"] = [
                    _ratio(o["ttft_p90_s"], c["ttft_p90_s"]) for o, c in each
                ]
                spread[f"throughput cache/{other}"] = [
                    _ratio(c["output_tokens_per_s"], o["output_tokens_per_s"]) for o, c in each
                ]
    return {"policies": by_policy, "ratios": ratios, "rounds": spread}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def table(result: dict[str, Any]) -> str:
    lines = [
        f"{'policy':<13}{'ttft p50':>9}{'p90':>8}{'p99':>8}{'itl p50':>9}{'p99':>8}"
        f"{'tok/s':>8}  cached share / requests per instance / same tokens"
    ]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    for policy, f in result["policies"].items():
        share = ", ".join(f"{t} {v:.0%}" for t, v in f["cached_share"].items()) or "none"
        spread = ", ".join(f"{k} {v}" for k, v in sorted(f["per_instance"].items()))
        rate = "-" if f["output_tokens_per_s"] is None else f"{f['output_tokens_per_s']:.1f}"
        lines.append(
            f"{policy:<13}{ms(f['ttft_p50_s']):>9}{ms(f['ttft_p90_s']):>8}{ms(f['ttft_p99_s']):>8}"
            f"{ms(f['itl_p50_s']):>9}{ms(f['itl_p99_s']):>8}{rate:>8}  {share} / {spread} / "
            f"{'yes' if f['same_tokens'] else 'NO'}"
        )
    for name, value in result["ratios"].items():
        rounds = result.get("rounds", {}).get(name, [])
        each = ", ".join("n/a" if v is None else f"{v:.2f}x" for v in rounds)
        by_round = f" (rounds: {each})" if len(rounds) > 1 else ""
        lines.append(f"  {name}: {'n/a' if value is None else f'{value:.2f}x'}{by_round}")
    lines.append("  (milliseconds; the median over rounds; cached share: of prompt tokens)")
    return "\n".join(lines)


def workload(args: argparse.Namespace) -> dict[str, Any]:
    """The workload's options: the case's, each one given on the command line instead."""
    case = CASES[args.case] | ({"rate": CASES[args.case]["sim_rate"]} if args.sim else {})
    chosen = {k: case[k] if getattr(args, k) is None else getattr(args, k) for k in WORKLOAD}
    return {k: float(v) if k == "rate" else int(v) for k, v in chosen.items()}


def main(args: argparse.Namespace) -> int:
    args = argparse.Namespace(**(vars(args) | workload(args)))
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"--policies: unknown {unknown}; known: {', '.join(POLICIES)}")
    if not args.rate > 0:
        raise ValueError("--rate must be > 0")
    for flag in ("instances", "groups", "users", "turns", "system_blocks", "max_tokens", "rounds"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if not 0 <= args.direct < args.users:
        raise ValueError("--direct must be >= 0 and below --users (someone must be routed)")
    if args.overlap_weight is not None and not args.overlap_weight >= 0:
        raise ValueError("--overlap-weight must be >= 0")
    settings = [*DEFAULT_SETTINGS, *args.overrides]
    sim = sim_model(args.sim_set) if args.sim else None
    if args.sim_set and sim is None:
        raise ValueError("--sim-set is for simulated instances: give --sim")
    requests = shared_prefix_requests(
        groups=args.groups, users=args.users, turns=args.turns,
        system_blocks=args.system_blocks, max_tokens=args.max_tokens, rate=args.rate,
    )  # fmt: skip
    router_options = []
    if args.overlap_weight is not None:
        router_options = ["--overlap-weight", str(args.overlap_weight)]
    began = time.perf_counter()
    rounds: list[dict[str, dict[str, Any]]] = []
    first_tokens: dict[str, tuple[int, ...]] | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="rf-bench-route-") as tmp:
            for index in range(args.rounds):
                turn = policies[index % len(policies) :] + policies[: index % len(policies)]
                sides: dict[str, dict[str, Any]] = {}
                for policy in turn:
                    folder = Path(tmp) / f"round-{index}" / policy
                    found = policy_side(
                        policy, requests, settings=settings, count=args.instances,
                        folder=folder, timeout=args.timeout, router_options=router_options,
                        direct=args.direct, sim=sim,
                    )  # fmt: skip
                    tokens = {t.id: t.token_ids for t in found["timelines"] if not t.error}
                    first_tokens = first_tokens or tokens
                    sides[policy] = {
                        "figures": figures(found["timelines"], found),
                        "same_tokens": tokens == first_tokens,
                    }
                rounds.append(sides)
    except RunError as e:
        print(f"ringfence bench route: {e}", file=sys.stderr)
        return 1
    result = {
        **environment(),
        "settings": [] if sim else settings,
        "instances": args.instances,
        "instances_kind": "serve" if sim is None else "sim",
        "cost_model": None if sim is None else sim.as_dict(),
        "requests": len(requests),
        "case": args.case,
        "workload": {k: getattr(args, k) for k in (*WORKLOAD, "max_tokens")},
        "overlap_weight": args.overlap_weight,
        "direct": args.direct,
        **report(policies, rounds),
        "wall_s": round(time.perf_counter() - began, 3),
    }  # fmt: skip
    shape = ", ".join(f"{k} {v:g}" for k, v in result["workload"].items())
    print(f"case {args.case} ({shape}; {len(requests)} requests)")
    if sim is not None:
        print("simulated instances: " + ", ".join(f"{k} {v:g}" for k, v in sim.as_dict().items()))
    print(table(result))
    plot = plot_path(args, "bench-route.png")
    _plot(plot, result)
    result["plot"] = str(plot)
    if args.json is not None:
        Path(args.json).write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
    bad = [p for p, f in result["policies"].items() if f["failed"] or not f["same_tokens"]]
    for policy in bad:
        print(f"ringfence bench route: {policy}: failed requests or other tokens", file=sys.stderr)
    return 1 if bad else 0


def _plot(path: Path, result: dict[str, Any]) -> None:
    from ringfence.actors.tools.bench.plot import write_ratio_plot

    ratios = [(name, value if value is not None else float("nan"), None)
              for name, value in result["ratios"].items()]  # fmt: skip
    if ratios:
        write_ratio_plot(path, ratios, title="bench route: the cache policy against the others")

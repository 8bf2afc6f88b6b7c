"""``ringfence bench sched``: the scheduler's host work per decode step, in one process, against
the time a device step takes.

With two steps in flight (``sched.steps_in_flight = 2``) the engine plans step N+1 while the
Worker runs step N, so its work is hidden only while it takes less than a device step: at
large batches on a GPU, the engine's turn (``bench decode``'s ``turn``) is what could make
the device wait. Most of that turn is the scheduler's: planning the next step
(``Scheduler.schedule``: the pieces, their blocks, the step's fence) and applying a result
(``Scheduler.on_step``: each sampled token into its request). This benchmark times both in
steady decode, with no process, ring or model around them, so that what is measured is the
scheduler's Python alone and its figure repeats.

For each batch size N: N requests of ``--context`` prompt tokens, all admitted and past
their prefill (untimed), then ``--steps`` decode steps timed with ``--in-flight`` steps
outstanding: plan until the scheduler has no room, apply the oldest step's result (one token
for every sequence it sampled), repeat. Reported per N: the median schedule and apply times
(ms a step), their sum per sequence (microseconds), and the sum over ``--device-step-ms``
(issue 46's target for a 1.1B model's decode forward at 64 sequences is 2.5 ms): below 1,
two steps in flight hide it. Pure: the scheduler (``ringfence.sched``) and nothing else.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import deque
from typing import Any

import orjson

from ringfence.sched.config import SchedConfig, SchedulerConfig, TierConfig
from ringfence.sched.ops import StepOp
from ringfence.sched.request import Request
from ringfence.sched.sampling import SamplingParams
from ringfence.sched.scheduler import Scheduler

BLOCK_SIZE = 16  # the runtime's default cache.block_size
VOCAB = 32000
MS = 1e3  # milliseconds per second


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register this benchmark's options (``--json`` is added by the CLI)."""
    parser.add_argument("--quick", action="store_true", help="N = 4 and 16, few steps (tests)")
    parser.add_argument("--seqs", help="batch sizes, comma-separated (1,8,64,256; quick 4,16)")
    parser.add_argument("--context", type=int, help="prompt tokens of each request (512)")
    parser.add_argument("--steps", type=int, help="timed decode steps (200; quick 10)")
    parser.add_argument(
        "--in-flight", type=int, choices=(1, 2), default=2, help="steps in flight (%(default)s)"
    )
    parser.add_argument(
        "--device-step-ms",
        type=float,
        default=2.5,
        help="the device step the work is set against (%(default)s ms)",
    )


def make_scheduler(seqs: int, context: int, steps: int, in_flight: int) -> Scheduler:
    """A scheduler with room for every sequence's whole run on the device."""
    blocks = seqs * (-(-(context + steps + 8) // BLOCK_SIZE) + 1)
    tiers = TierConfig(
        block_size=BLOCK_SIZE,
        device_blocks=blocks,
        host_blocks=1,
        host_cache=False,
        storage=False,
        poison_freed=True,
    )
    config = SchedulerConfig(
        sched=SchedConfig(max_num_seqs=seqs, max_batched_tokens=max(8192, context)),
        tiers=tiers,
        namespace=b"\0" * 16,
        steps_in_flight=in_flight,
    )
    return Scheduler(config)


def measure(seqs: int, context: int, steps: int, in_flight: int, seed: int = 0) -> dict[str, Any]:
    """The scheduler's times in steady decode of ``seqs`` sequences (module docstring)."""
    sched = make_scheduler(seqs, context, steps, in_flight)
    rng = random.Random(seed)
    for i in range(seqs):
        prompt = tuple(rng.randrange(VOCAB) for _ in range(context))
        params = SamplingParams(max_tokens=steps + 8 * in_flight + 8, ignore_eos=True)
        sched.add(Request(request_id=f"r{i}", prompt_token_ids=prompt, params=params))
    issued: deque[StepOp] = deque()
    plans: list[float] = []
    applies: list[float] = []
    prefill = -(-seqs * context // sched.config.sched.max_batched_tokens)  # steps of it
    for _ in range(prefill + steps + 4 * in_flight + 4):
        began = time.perf_counter()
        planned_steps = []
        while sched.can_schedule:
            step = next((op for op in sched.schedule() if isinstance(op, StepOp)), None)
            if step is None:
                break
            planned_steps.append(step)
        planned = time.perf_counter()
        issued.extend(planned_steps)
        if not issued:
            raise RuntimeError(f"the scheduler planned nothing at {seqs} sequences")
        op = issued.popleft()
        tokens = [(p.seq_id, rng.randrange(VOCAB)) for p in op.pieces if p.sample]  # its result
        result = time.perf_counter()
        sched.on_step(op.step, "ok", tokens)
        applied = time.perf_counter()
        # Timed only when every step of the turn is a decode of every sequence.
        if planned_steps and all(_steady(s, seqs) for s in (*planned_steps, op)):
            plans.append(planned - began)
            applies.append(applied - result)
            if len(applies) == steps:
                break
    if not applies:
        raise RuntimeError(f"no steady decode turn at {seqs} sequences")
    plan_ms, apply_ms = statistics.median(plans) * MS, statistics.median(applies) * MS
    return {
        "seqs": seqs,
        "steps": len(applies),
        "schedule_ms": plan_ms,
        "apply_ms": apply_ms,
        "per_seq_us": (plan_ms + apply_ms) * 1e3 / seqs,
    }


def _steady(step: StepOp, seqs: int) -> bool:
    """Whether ``step`` decodes one token of each of the ``seqs`` sequences."""
    return len(step.pieces) == seqs and all(len(p.token_ids) == 1 for p in step.pieces)


def main(args: argparse.Namespace) -> int:
    seqs = [int(n) for n in (args.seqs or ("4,16" if args.quick else "1,8,64,256")).split(",")]
    context = args.context if args.context is not None else 64 if args.quick else 512
    steps = args.steps if args.steps is not None else 10 if args.quick else 200
    if min(seqs) < 1 or context < 1 or steps < 1 or args.device_step_ms <= 0:
        raise ValueError("--seqs, --context, --steps and --device-step-ms must be positive")
    points = [measure(n, context, steps, args.in_flight) for n in seqs]
    print(
        f"the scheduler alone, one process: {context} prompt tokens a sequence, "
        f"{args.in_flight} step(s) in flight, {steps} steady decode steps timed (medians)"
    )
    print(f"{'N':>5} {'schedule':>9} {'apply':>7} {'per seq':>8} {'/ device step':>14}")
    for p in points:
        p["over_device_step"] = (p["schedule_ms"] + p["apply_ms"]) / args.device_step_ms
        print(
            f"{p['seqs']:>5} {p['schedule_ms']:>9.3f} {p['apply_ms']:>7.3f} "
            f"{p['per_seq_us']:>8.2f} {p['over_device_step']:>14.2f}"
        )
    print(
        f"ms a step; per seq: microseconds of both; / device step: their sum over "
        f"{args.device_step_ms} ms (below 1: two steps in flight hide it)"
    )
    if args.json is not None:
        report = {
            "context": context,
            "in_flight": args.in_flight,
            "device_step_ms": args.device_step_ms,
            "points": points,
        }
        args.json.write_bytes(orjson.dumps(report, option=orjson.OPT_INDENT_2))
    return 0

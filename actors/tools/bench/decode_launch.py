"""One ``ringfence launch`` of ``bench decode``'s requests, and what its logs say a decode step
is made of.

The workload is ``seqs`` requests of ``prompt_tokens`` random token ids, all arriving at
once, each decoding exactly ``output_tokens`` tokens (``ignore_eos``), with
``sched.max_num_seqs`` = ``seqs`` and a device pool that holds every one of them whole, so
that nothing waits for room. From its files:

* ``summary.json`` and ``outputs.jsonl``: output tokens per second over the run, TTFT p50,
  TPOT p50 and p90 (the engine's own definitions, ``actors/engine/summary.py``);
* the Worker's ``step.done`` lines: each step's ``forward_ns`` and ``sample_ns`` (where the
  Worker writes them; else its ``exec_ns`` counts as forward and sampling is unknown);
* the engine's trace lines (``runtime.log_level = trace``): ``op.issue`` of a step (when it
  was sent) and ``sched.step`` (when its result was received).

A step of steady decode (every one of the ``seqs`` sequences decoding one token, after a
step that did too) lasts from the previous step's end to its own, as the Worker's
``step.done`` lines time them, and is split into ``forward`` and ``sampling`` (the
Worker's), ``engine`` (trace level: from the previous step's end to this step's issue, the
time the Worker had no plan to run because the engine had not sent it; none with
``sched.steps_in_flight`` 2 while the engine keeps ahead) and ``idle``, the rest: the rings
both ways and the Worker's own checks and bookkeeping around the forward. At the info level
the engine's lines are absent and ``engine`` and ``idle`` are one figure, ``between``.
Timing a step end to end rather than issue to issue matters with two steps in flight: the
first decode step is issued before the prefill ends, so its issue-to-issue span holds the
prefill. ``device_busy`` is the forward's share of the steady decode's wall time: on CUDA,
how busy the GPU was kept. ``worker_cycle`` is the same cycle over the step's ``exec_ns``
(its forward and sampling with their checks); 1.0 would be a Worker that never waits
between steps. ``engine_turn`` (trace level) is the engine's own view: from a steady step's
result received to the next step issued after it, whether or not that lies on the step's
path. With two steps in flight it is hidden while it is shorter than the Worker's execution
(``over_exec`` below 1); on a GPU, that is what keeps the device from waiting for the host
at large batches. ``checked_ahead`` is the share of the steady steps whose plan the Worker
checked while the step before it ran (``step.done``'s ``checked_ahead``), ``launched_ahead``
the share whose kernels it queued before it reported the step before (``model.launch_ahead``),
and ``launched_early`` those of them queued before the step before's tokens were read back:
such a step's execution began inside the step before's, so the cycle over the execution may
fall below 1.
"""

from __future__ import annotations

import bisect
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from ringfence.actors.engine.percentiles import percentile
from ringfence.actors.tools.bench import launcher
from ringfence.actors.tools.bench.launcher import RunError

BLOCK_SIZE = 16  # the runtime's default cache.block_size
MS = 1e-6  # milliseconds per nanosecond
MAX_BATCHED = 8192  # a GPU server's sched.max_batched_tokens: the prompts' prefill steps


@dataclass(frozen=True, slots=True, kw_only=True)
class Shape:
    """The requests of one launch."""

    seqs: int
    prompt_tokens: int
    output_tokens: int
    vocab_size: int
    seed: int = 0


def write_workload(path: Path, shape: Shape) -> None:
    """The workload file of ``shape``: random prompts (seeded), all arriving at time 0."""
    gen = random.Random(shape.seed)
    lines = [
        {
            "id": f"r{i}",
            "prompt_token_ids": [
                gen.randrange(shape.vocab_size) for _ in range(shape.prompt_tokens)
            ],
            "max_tokens": shape.output_tokens,
            "ignore_eos": True,
            "arrival_s": 0.0,
        }
        for i in range(shape.seqs)
    ]
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))


def settings(shape: Shape, given: Sequence[str], *, trace: bool) -> list[str]:
    """The launch's ``--set`` overrides: the batch's, the pool's and the log level, then
    ``given`` (the model's, and the user's, which win)."""
    per_seq = -(-(shape.prompt_tokens + shape.output_tokens) // BLOCK_SIZE)
    prefill = shape.seqs * shape.prompt_tokens
    return [
        f"sched.max_num_seqs={shape.seqs}",
        f"sched.max_batched_tokens={max(shape.prompt_tokens, min(prefill, MAX_BATCHED))}",
        f"cache.device_blocks={shape.seqs * per_seq + shape.seqs}",  # ample: one spare each
        "cache.storage.backend=none",  # nothing to keep: the requests never come back
        f"runtime.log_level={'trace' if trace else 'info'}",
        *given,
    ]


def launch_figures(
    folder: Path, shape: Shape, given: Sequence[str], *, trace: bool, timeout: float,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Launch the requests of ``shape`` in a run dir under ``folder``, with the ``--set``
    overrides ``given`` after its own, and read its figures (see the module docstring).
    RunError naming the run when it fails or a request is cut short."""
    folder.mkdir(parents=True, exist_ok=True)
    workload = folder / f"decode-{shape.seqs}.jsonl"
    write_workload(workload, shape)
    run_dir = folder / f"run-{shape.seqs}"
    done = launcher.run(
        run_dir,
        settings(shape, given, trace=trace),
        what=f"decode launch at {shape.seqs} seqs",
        timeout=timeout,
        workload=str(workload),
        env=env,
        needs_summary=True,
    )
    lengths = [len(line["token_ids"]) for line in done.outputs]
    if lengths != [shape.output_tokens] * shape.seqs:
        raise RunError(f"decode launch at {shape.seqs} seqs: output lengths {sorted(set(lengths))}")
    tpot = [t for line in done.outputs if (t := line.get("tpot_s")) is not None]
    ttft = [t for line in done.outputs if (t := line.get("ttft_s")) is not None]
    summary = done.summary
    return {
        "run_dir": str(run_dir),
        "log_level": "trace" if trace else "info",
        "wall_s": done.wall_s,
        "duration_s": summary["duration_s"],
        "output_tokens": summary["tokens"]["output"],
        "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
        "ttft_p50_ms": percentile(ttft, 50) * 1e3 if ttft else None,
        "tpot_p50_ms": percentile(tpot, 50) * 1e3 if tpot else None,
        "tpot_p90_ms": percentile(tpot, 90) * 1e3 if tpot else None,
        "step": step_split(
            launcher.read_log(run_dir, "worker-0"),
            launcher.read_log(run_dir, "engine-0") if trace else None,
            shape.seqs,
        ),
    }


def step_split(
    worker: Sequence[dict[str, Any]], engine: Sequence[dict[str, Any]] | None, seqs: int
) -> dict[str, Any]:
    """The mean steady decode step and its parts, in milliseconds (see the module
    docstring): means, so that the parts add up to the step. RunError when the run had no
    steady decode step."""
    done = {
        e["step"]: e
        for e in worker
        if e["event"] == "step.done" and e["status"] == "ok" and e["pieces"] == e["tokens"] == seqs
    }
    issued: dict[int, int] = {}
    received: dict[int, int] = {}
    for e in engine or ():
        if e["event"] == "op.issue" and e["lane"] == "step":
            issued[e["op"]] = e["mono_ns"]
        elif e["event"] == "sched.step":
            received[e["step"]] = e["mono_ns"]
    rows: list[dict[str, int | None]] = []
    timed = all(line.get("forward_ns") is not None for line in done.values())
    for step, line in sorted(done.items()):
        if step - 1 not in done:
            continue  # the first steady step: its cycle starts at a prefill's end
        # A Worker that times only the whole execution: it all counts as the forward.
        forward = line["forward_ns"] if timed else line["exec_ns"]
        sample = line["sample_ns"] if timed else None
        cycle = line["mono_ns"] - done[step - 1]["mono_ns"]
        row: dict[str, int | None] = {"step": cycle, "exec": line["exec_ns"]}
        row["ahead"] = int(bool(line.get("checked_ahead")))
        row["launched"] = int(bool(line.get("launched_ahead")))
        row["early"] = int(line.get("launched_ahead") == "early")
        row |= {"forward": forward, "sampling": sample}
        if engine is None:
            row |= {"engine": None, "idle": None}
        elif step in issued:
            # The Worker had no plan to run until the engine sent it.
            engine_ns = min(max(issued[step] - done[step - 1]["mono_ns"], 0), cycle)
            row |= {"engine": engine_ns, "idle": cycle - forward - (sample or 0) - engine_ns}
        else:
            continue  # an engine log that lacks the step's issue (a cut log)
        rows.append(row)
    if not rows:
        raise RunError(f"no steady decode step of {seqs} sequences in the run's logs")

    def mean_ms(key: str) -> float | None:
        values = [row[key] for row in rows]
        return None if None in values else statistics.fmean(values) * MS  # type: ignore[arg-type]

    step_ms = mean_ms("step")
    assert step_ms is not None
    parts = {key: mean_ms(key) for key in ("forward", "sampling", "engine", "idle")}
    steady_ns = sum(row["step"] or 0 for row in rows)
    forward_ns = sum(row["forward"] or 0 for row in rows)
    exec_ns = sum(row["exec"] or 0 for row in rows)
    # The engine's turn: a steady step's result received to the next steady step issued.
    by_time = sorted((ns, op) for op, ns in issued.items())
    turns = []
    for step in done:
        if step in received:
            i = bisect.bisect_right(by_time, (received[step], 1 << 62))
            if i < len(by_time) and by_time[i][1] in done:
                turns.append(by_time[i][0] - received[step])
    turn_ns, turn_exec_ns = sum(turns), statistics.fmean(e["exec_ns"] for e in done.values())
    return {
        "steady_steps": len(rows),
        "step_ms": step_ms,
        "parts_ms": parts,
        "between_ms": step_ms - (parts["forward"] or 0.0) - (parts["sampling"] or 0.0),
        "forward_source": "forward_ns" if timed else "exec_ns",
        "device_busy": forward_ns / steady_ns if steady_ns > 0 else None,
        # The steps whose plan the Worker checked while the step before ran (look_ahead.py).
        "checked_ahead": sum(row["ahead"] or 0 for row in rows) / len(rows),
        # Those whose kernels it queued before it reported the step before (worker.py).
        "launched_ahead": sum(row["launched"] or 0 for row in rows) / len(rows),
        # Of them, those queued before its tokens were read back, on them on the device.
        "launched_early": sum(row["early"] or 0 for row in rows) / len(rows),
        "worker_cycle": {  # the same steps over their execution
            "steps": len(rows),
            "cycle_ms": step_ms,
            "exec_ms": exec_ns / len(rows) * MS,
            "over_exec": steady_ns / exec_ns if exec_ns > 0 else None,
        },
        "engine_turn": {
            "steps": len(turns),
            "turn_ms": turn_ns / len(turns) * MS if turns else None,
            "over_exec": turn_ns / len(turns) / turn_exec_ns if turns and turn_exec_ns else None,
        },
    }

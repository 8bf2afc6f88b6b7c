"""Ops that fail part way through a real run lose no request, and no wrong KV is kept.

Every actor runs in this process (inproc.py) with executors that break: some swap copies
and some steps write garbage (finite, so nothing but the protocol can tell) and then
raise. A failed op still advances its watermark, so the ops fenced on it go ahead before
the engine hears of the failure: a write-through stores the blocks a swap-out was
filling, a step reads the blocks a swap-in was filling. What must hold: the failed op
spoils what it was writing (NaN), a step that reads a spoil fails instead of sampling,
the store lane refuses to store a spoiled block, and the engine computes each request of
a failed step again. So every request gets the plain loop's tokens, and no stored block
holds the garbage.
"""

from __future__ import annotations

import itertools
import struct
from pathlib import Path
from typing import Any, ClassVar

import orjson
from engine_runs import replayed
from inproc import inproc_run
from random_workloads import ENGINE, RUN_TIMEOUT_S, outputs, reference, write_workload

from ringfence.actors.executors.swap import SwapLane
from ringfence.actors.executors.worker import Worker
from ringfence.sched.ops import Piece, SwapOp

GARBAGE = 31337.5  # what a copy or step that broke part way leaves: finite, plausible
SETS = (
    *ENGINE,
    "cache.device_blocks=16",
    "cache.host_blocks=24",
    "cache.storage.backend=local",
    "sched.preemption=swap",
    "cache.device_eviction=write_through",  # a step's blocks are copied out as it fills them
    "cache.host_eviction=write_through",  # and a swap-out's blocks written on to storage
    "transfer.chaos_delay_ms=1",
    "runtime.log_level=trace",  # for ringfence replay --redrive
)


class BrokenSwaps(SwapLane):
    """The 2nd and 6th swap-out, and the 3rd and 9th swap-in, write garbage, then raise."""

    broken: ClassVar = {"out": {2, 6}, "in": {3, 9}}

    def on_start(self) -> None:
        super().on_start()
        self.calls = {"out": itertools.count(1), "in": itertools.count(1)}

    def _copy(self, msg: SwapOp) -> int:
        if next(self.calls[msg.direction]) in self.broken[msg.direction]:
            assert self.device is not None
            if msg.direction == "in":
                self.device.kv[list(msg.device_blocks)] = GARBAGE
            else:
                self.host_kv[list(msg.host_blocks)] = GARBAGE
            raise OSError(f"swap-{msg.direction} {msg.op} broke part way")
        return super()._copy(msg)


class BrokenSteps(Worker):
    """The 4th and 12th step that runs the model writes garbage KV, then raises."""

    def on_start(self) -> None:
        super().on_start()
        assert self.executor is not None
        executor, real, calls = self.executor, self.executor.step, itertools.count(1)

        def step(pieces: list[Piece], **options: Any) -> Any:
            out = real(pieces, **options)
            if next(calls) in (4, 12):
                bs = executor.block_size
                for p in pieces:
                    end = p.start + len(p.token_ids)
                    executor.kv[list(p.block_table[p.start // bs : -(-end // bs)])] = GARBAGE
                raise RuntimeError("the step broke after writing its KV")
            return out

        executor.step = step  # type: ignore[method-assign,assignment]


def stored_garbage(storage: Path) -> list[str]:
    needle = struct.pack("<d", GARBAGE) * 4
    return [p.name for p in storage.rglob("*") if p.is_file() and needle in p.read_bytes()]


def events(run_dir: Path, log: str, name: str) -> list[dict[str, Any]]:
    lines = (run_dir / f"{log}.jsonl").read_bytes().splitlines()
    return [e for e in map(orjson.loads, lines) if e["event"] == name]


def test_failed_swaps_and_steps_are_spoiled_refused_and_computed_again(tmp_path):
    workload = write_workload(tmp_path / "workload.jsonl", seed=5, requests=8)
    run_dir = tmp_path / "run"
    classes = {"swap": BrokenSwaps, "worker": BrokenSteps}
    with inproc_run(run_dir, (*SETS, f"engine.workload={workload}"), classes=classes) as run:
        assert run.wait_shutdown(RUN_TIMEOUT_S), "the workload did not finish"
        assert run.failures() == {}
    assert outputs(run_dir) == reference(workload)
    failed = {(e["lane"], e["error"].split()[0]) for e in events(run_dir, "swap-0", "lane.failed")}
    assert {("swap", "OSError('swap-in"), ("swap", "OSError('swap-out")} <= failed, failed
    assert events(run_dir, "worker-0", "step.failed"), "no step failed"
    refused = [e for e in events(run_dir, "store-0", "lane.failed") if "all NaN" in e["error"]]
    assert refused, "no write-back met a spoiled block: the run did not test the refusal"
    assert stored_garbage(run_dir / "storage") == []
    engine = orjson.loads((run_dir / "summary.json").read_bytes())["engine"]
    assert engine["retries"] > 0, engine
    replayed(run_dir)  # every check holds, and redrive repeats every retry decision

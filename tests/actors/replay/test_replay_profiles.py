"""``transfer.profile``: each executor's profiler trace, put on the run's clock by replay.

A profile's own clock is pinned by its ``ringfence.clock <wall ns>`` range; the test of a
launched run checks that every step's range lands on the step's slice from the logs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson
import pytest
from engine_runs import TIERS, finished, workload_sets
from launching import launched

from ringfence.actors.replay.log import read_run
from ringfence.actors.replay.profiles import profile_files, read_profile
from ringfence.actors.replay.trace import write_trace

WALL_NS = 1_700_000_000_000_000_000


def trace_file(path: Path, events: list[dict[str, Any]]) -> Path:
    path.write_bytes(orjson.dumps({"traceEvents": events, "baseTimeNanoseconds": 0}))
    return path


def x(name: str, cat: str, ts: float, dur: float, pid: int = 9, tid: int = 3) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid}


def test_a_profile_is_read_onto_the_wall_clock_its_clock_range_names(tmp_path):
    path = trace_file(
        tmp_path / "profile-worker-0.2.json",
        [
            {"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "python"}},
            x(f"ringfence.clock {WALL_NS}", "user_annotation", 1000.0, 1.0),
            x("step 1", "user_annotation", 3000.0, 500.0),
            x("aten::mm", "cpu_op", 3100.0, 100.0),  # host-side torch ops are left out
            x("gemm_kernel", "kernel", 3200.0, 250.0, pid=0, tid=7),
            x("Memcpy DtoH", "gpu_memcpy", 3600.0, 40.0, pid=0, tid=13),
        ],
    )
    slices = read_profile(path)
    base = WALL_NS / 1e9
    assert [(s.source, s.track, s.name, s.category) for s in slices] == [
        ("worker-0", "ops (thread 3)", "step 1", "user_annotation"),
        ("worker-0", "gpu 0 stream 7", "gemm_kernel", "kernel"),
        ("worker-0", "gpu 0 stream 13", "Memcpy DtoH", "gpu_memcpy"),
    ]
    # To a microsecond: wall-clock seconds near 1.7e9 hold little more.
    assert [s.start - base for s in slices] == pytest.approx([2e-3, 2.2e-3, 2.6e-3], abs=1e-6)
    assert [s.duration for s in slices] == pytest.approx([5e-4, 2.5e-4, 4e-5])


def test_a_profile_without_its_clock_range_is_a_value_error_naming_the_file(tmp_path):
    unpinned = [x("swap-out 1", "user_annotation", 1, 1)]
    path = trace_file(tmp_path / "profile-swap-0.1.json", unpinned)
    with pytest.raises(ValueError, match=re.escape("swap-0.1.json: no ringfence.clock range")):
        read_profile(path)
    (tmp_path / "profile-store-0.1.json").write_text("{")
    with pytest.raises(ValueError, match=re.escape("store-0.1.json: not a profiler trace")):
        read_profile(tmp_path / "profile-store-0.1.json")


def test_each_steps_profiled_range_lands_on_its_slice_in_the_runs_trace(tmp_path):
    sets = workload_sets(
        "pressure", *TIERS, "sched.preemption=swap", "transfer.profile=true", requests=2
    )
    with launched(tmp_path, *sets) as run:
        finished(run)
    files = [p.name for p in profile_files(run.run_dir)]
    assert "profile-worker-0.1.json" in files and "profile-swap-0.1.json" in files
    profiled = [s for p in profile_files(run.run_dir) for s in read_profile(p)]
    trace = tmp_path / "trace.json"
    write_trace(read_run(run.run_dir), trace, profiled)
    events = orjson.loads(trace.read_bytes())["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "process_name"}
    pid = next(p for p, name in names if name == "worker-0")
    logged = {e["name"]: e for e in events if e["pid"] == pid and e.get("cat") == "op"}
    ranges = {
        e["name"]: e
        for e in events
        if e["pid"] == pid and e.get("cat") == "user_annotation" and e["name"].startswith("step")
    }
    assert len(ranges) >= 10 and set(ranges) <= set(logged), sorted(set(ranges) - set(logged))
    for name, profiled_range in ranges.items():
        slice_ = logged[name]  # in microseconds from the run's first moment
        assert slice_["ts"] - 50e3 <= profiled_range["ts"], name
        end = profiled_range["ts"] + profiled_range["dur"]
        assert end <= slice_["ts"] + slice_["dur"] + 50e3, name
    swaps = [s for s in profiled if s.source == "swap-0" and s.name.startswith("swap-")]
    assert swaps, "the swap lane's ops have no ranges"

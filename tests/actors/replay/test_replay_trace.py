"""The Chrome trace of a run's logs: tracks, op slices, fence flows, requests, lost ops."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from ringfence.actors.replay.log import read_run
from ringfence.actors.replay.trace import write_trace

T0 = 1_700_000_000.0


def near(value: object) -> Any:
    """Within half a microsecond: wall-clock seconds near 1.7e9 hold little more."""
    return pytest.approx(value, abs=0.5)


def line(actor: str, at_ms: float, event: str, **fields: Any) -> dict[str, Any]:
    common = {"ts": T0 + at_ms / 1e3, "mono_ns": 0, "level": "info", "actor": actor, "rank": 0}
    return common | {"pid": 1, "epoch": 0} | fields | {"event": event}


def lane_done(lane: str, op: int, at_ms: float, direction: str, wait_ms: float, copy_ms: float):
    return line(
        lane, at_ms, "lane.done", lane=lane, op=op, op_epoch=0, status="ok",
        direction=direction, fence_step=1 if op == 2 else 0, fence_swap=0, fence_store=0,
        seen_step=1 if op == 2 else 0, seen_swap=None, seen_store=0, error=None, missing=None,
        blocks=2, wait_ns=int(wait_ms * 1e6), copy_ns=int(copy_ms * 1e6),
    )  # fmt: skip


def step_done(
    step: int, at_ms: float, status: str, fence_swap: int, wait_ms: float, exec_ms: float
):
    return line(
        "worker", at_ms, "step.done", step=step, plan_epoch=0, status=status,
        fence_swap=fence_swap, fence_store=0, seen_swap=fence_swap, seen_store=0, pieces=1,
        tokens=20, poison=0, wait_ns=int(wait_ms * 1e6), exec_ns=int(exec_ms * 1e6), error=None,
    )  # fmt: skip


def issue(lane: str, op: int, at_ms: float, fence: dict[str, int], **fields: Any):
    return line("engine", at_ms, "op.issue", level="trace", lane=lane, op=op, fence=fence,
                sync=False, **fields)  # fmt: skip


LOGS = {
    "supervisor-0": [line("supervisor", 0, "run.start", run_id="x", instances=[])],
    "engine-0": [
        line(
            "engine",
            1,
            "request.arrive",
            request="r0",
            seq_id=0,
            prompt_tokens=20,
            max_tokens=4,
            arrival_s=0.0,
        ),
        line(
            "engine",
            1.5,
            "sched.schedule",
            level="trace",
            ops=[["swap", 1], ["step", 1]],
            decisions=[],
        ),
        issue(
            "swap",
            1,
            2,
            {},
            direction="in",
            reason="resume",
            device_blocks=[0, 1],
            host_blocks=[3, 4],
        ),
        issue("step", 1, 3, {"swap": 1}, pieces=[[0, 0, 20, True, [0, 1]]], poison=[]),
        issue(
            "swap",
            2,
            4,
            {"step": 1},
            direction="out",
            reason="preempt",
            device_blocks=[0, 1],
            host_blocks=[5, 6],
        ),
        issue("store", 1, 5, {"swap": 2}, direction="write", reason="demote", host_blocks=[5]),
        issue("step", 2, 6, {"swap": 2}, pieces=[[0, 20, 1, True, [0, 1]]], poison=[]),
        line(
            "engine",
            30,
            "request.finish",
            request="r0",
            reason="length",
            output_tokens=4,
            cached_tokens={"device": 0, "host": 16, "storage": 0},
            error=None,
        ),
    ],
    "swap-0": [lane_done("swap", 1, 10, "in", 1, 2), lane_done("swap", 2, 25, "out", 2, 3)],
    "worker-0": [step_done(1, 18, "ok", 1, 3, 4), step_done(2, 26, "cancelled", 2, 0, 0)],
}


@pytest.fixture
def trace(tmp_path: Path) -> tuple[int, list[dict[str, Any]], dict[str, Any]]:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for source, lines in LOGS.items():
        (run_dir / f"{source}.jsonl").write_bytes(b"".join(orjson.dumps(x) + b"\n" for x in lines))
    count = write_trace(read_run(run_dir), tmp_path / "trace.json")
    document = orjson.loads((tmp_path / "trace.json").read_bytes())
    return count, document["traceEvents"], document


def names(events: list[dict[str, Any]]) -> tuple[dict[int, str], dict[int, tuple[int, str]]]:
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    threads = {
        e["tid"]: (e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"
    }
    return processes, threads


def slices(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in events if e["ph"] == "X" and e["cat"] == "op"}


def test_write_trace_has_a_process_per_actor_and_a_thread_per_lane(trace):
    count, events, document = trace
    assert count == len(events) and document["displayTimeUnit"] == "ms"
    processes, threads = names(events)
    # store-0 logged nothing, but its lane lost an op
    assert sorted(processes.values()) == [
        "engine-0",
        "store-0",
        "supervisor-0",
        "swap-0",
        "worker-0",
    ]
    pid = {name: p for p, name in processes.items()}
    assert set(threads.values()) >= {
        (pid["worker-0"], "step lane"), (pid["swap-0"], "swap lane"),
        (pid["engine-0"], "scheduler"), (pid["engine-0"], "requests"),
    }  # fmt: skip
    tids = [e["tid"] for e in events if e["name"] == "thread_name"]
    assert len(set(tids)) == len(tids)  # unique across processes: Perfetto takes them as global


def test_each_completed_op_is_a_slice_on_its_lane_with_its_fence_wait(trace):
    _, events, _ = trace
    _, threads = names(events)
    ops = slices(events)
    assert sorted(ops) == ["step 1", "step 2", "swap-in 1", "swap-out 2"]
    assert [threads[ops[n]["tid"]][1] for n in ("step 1", "swap-in 1")] == [
        "step lane",
        "swap lane",
    ]
    swap_in = ops["swap-in 1"]  # ends at 10 ms, after 1 ms waiting and 2 ms copying
    assert swap_in["ts"] == near(7000) and swap_in["dur"] == near(3000)
    assert swap_in["args"]["status"] == "ok" and swap_in["args"]["wait_ms"] == 1
    step = ops["step 1"]
    assert step["ts"] == near(11000) and step["dur"] == near(7000)
    assert step["args"]["fence"] == {"swap": 1, "store": 0} and step["args"]["seen_swap"] == 1
    assert step["args"]["tokens"] == 20
    waits = [e for e in events if e["name"] == "fence wait" and e["tid"] == step["tid"]]
    (wait,) = waits  # step 2 was cancelled: no time waited
    assert (wait["ts"], wait["dur"]) == near((11000, 3000))
    assert ops["step 2"]["args"]["status"] == "cancelled" and ops["step 2"]["dur"] > 0


def test_fence_flows_run_from_the_end_of_the_awaited_op_into_the_waiting_one(trace):
    _, events, _ = trace
    ops = slices(events)
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    assert starts.keys() == ends.keys() and len(starts) == 3

    def holder(event: dict[str, Any]) -> str:
        (name,) = [
            n for n, x in ops.items()
            if (x["pid"], x["tid"]) == (event["pid"], event["tid"])
            and x["ts"] < event["ts"] < x["ts"] + x["dur"]
        ]  # fmt: skip
        return name

    pairs = {(holder(starts[i]), holder(ends[i])) for i in starts}
    assert pairs == {("swap-in 1", "step 1"), ("step 1", "swap-out 2"), ("swap-out 2", "step 2")}
    assert all(e["bp"] == "e" and e["cat"] == "fence" for e in ends.values())


def test_lost_ops_requests_and_the_scheduler_are_marked(trace):
    _, events, _ = trace
    processes, threads = names(events)
    (lost,) = [e for e in events if "never completed" in e["name"]]
    assert lost["name"] == "write-back 1 never completed" and lost["ph"] == "i"
    assert threads[lost["tid"]][1] == "store lane" and processes[lost["pid"]] == "store-0"
    begin, end = [e for e in events if e["ph"] in "be"]
    assert (begin["ph"], end["ph"], begin["id"], end["id"]) == ("b", "e", "r0", "r0")
    assert (begin["ts"], end["ts"]) == near((1000, 30000))
    assert begin["args"]["prompt_tokens"] == 20 and end["args"]["output_tokens"] == 4
    issued = [e["name"] for e in events if e["ph"] == "i" and e["cat"] == "sched"]
    assert issued[:3] == ["schedule", "issue swap-in 1", "issue step 1"]
    assert any(e["name"] == "run.start" for e in events)

"""``ringfence replay`` on a run with two ranks (docs/design.md, "Ranks (tensor
parallelism)"): every op goes to every rank, rank r's executor waits on rank r's watermarks
alone, and the engine counts an op complete once every rank reported it. So each check reads
each rank's completion on its own, and a finding names the executor it is about."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from replay_logs import ENGINE, Logs

from ringfence.actors.replay.checks import check_run
from ringfence.actors.replay.findings import CheckResult
from ringfence.actors.replay.log import read_run
from ringfence.actors.replay.records import RunLog
from ringfence.actors.replay.trace import write_trace

OpSpec = tuple[str, int, dict[str, Any]]

# As in test_replay: a swap-in fills device block 0, step 1 reads it and writes block 1,
# a swap-out copies block 1 to host 11, a write-back stores host 11; each fences the last.
CLEAN: list[OpSpec] = [
    ("swap", 1, {"direction": "in", "device": [0], "host": [10]}),
    ("step", 1, {"fence": {"swap": 1}, "pieces": [[0, 4, 1, True, [0, 1]]]}),
    ("swap", 2, {"fence": {"step": 1}, "direction": "out", "device": [1], "host": [11]}),
    ("store", 1, {"fence": {"swap": 2}, "direction": "write", "host": [11]}),
]
# swap-in 2 refills device block 0, which step 1 read
REFILL = [
    *CLEAN[:2],
    ("swap", 2, {"fence": {"step": 1}, "direction": "in", "device": [0], "host": [12]}),
]
# a prefetch refills host block 10, which swap-in 1 copies to the device
PREFETCH = [CLEAN[0], ("store", 1, {"fence": {"swap": 1}, "direction": "read", "host": [10]})]


def build(ops: list[OpSpec], **changes: Any) -> Logs:
    """Two ranks; request r1 arrives, the ops run one after another, r1 finishes.
    ``changes``: ``"<lane><number>"`` -> keyword arguments replacing that op's."""
    logs = Logs(ranks=2)
    logs.arrive("r1")
    for lane, number, kwargs in ops:
        logs.op(lane, number, **(kwargs | changes.get(f"{lane}{number}", {})))
    logs.finish("r1")
    return logs


def replay(logs: Logs, run_dir: Path) -> tuple[RunLog, CheckResult]:
    log = read_run(logs.write(run_dir))
    return log, check_run(log)


def messages(result: CheckResult) -> list[str]:
    return [f"[{v.check}] {v.message}" for v in result.violations]


@pytest.mark.parametrize("ops", [CLEAN, REFILL, PREFETCH], ids=["clean", "refill", "prefetch"])
def test_a_clean_two_rank_history_holds_every_check(ops, tmp_path):
    log, result = replay(build(ops), tmp_path)
    assert log.traced and not log.warnings
    assert log.ranks("step") == log.ranks("swap") == log.ranks("store") == (0, 1)
    assert result.ok, messages(result)
    assert result.in_flight == []
    assert result.counts["I1-I4 ops"] == len(ops)
    assert result.counts["wait"] == result.counts["lanes"] == 2 * len(ops)  # each rank's


def test_every_rank_completes_an_op_after_its_issue_and_before_the_engine_applies_it(tmp_path):
    logs = build(CLEAN)
    for line in logs.files["worker-1"] + logs.files["swap-1"]:
        line["ts"] -= 5.0  # rank 1's clocks run five seconds behind
    log, result = replay(logs, tmp_path)
    assert result.ok and not log.warnings
    for op in log.ops.values():
        first = op.first_done()
        assert sorted(first) == [0, 1]
        assert op.issue is not None and op.applied
        for done in first.values():
            assert op.issue.order < done.order < op.applied[0].order


@pytest.mark.parametrize("rank", [0, 1])
def test_a_step_that_ran_before_its_ranks_swap_in_was_done_breaks_i1_at_that_rank(rank, tmp_path):
    # The other rank's swap-in was done: its completion does not vouch for this rank.
    logs = build(CLEAN, step1={"seen_at": {rank: {"swap": 0}}})
    _, result = replay(logs, tmp_path)
    assert messages(result) == [
        f"[I1] worker-{rank}: step 1 read device block 0 having seen swap_done at 0, before "
        "swap-in 1 (which wrote it) was done",
        f"[wait] worker-{rank}: step 1 ran having seen swap_done at 0; its fence names swap 1",
    ]
    invariant = result.violations[0]
    assert invariant.at is not None and invariant.at.source == f"worker-{rank}"
    assert {e.source for e in invariant.entries} == {f"worker-{rank}", ENGINE, f"swap-{rank}"}


@pytest.mark.parametrize(
    ("ops", "change", "expected"),
    [
        (CLEAN, {"swap2": {"seen_at": {1: {"step": 0}}}},
         "[I2] swap-1: swap-out 2 read device block 1 having seen step_done at 0"),
        (REFILL, {"swap2": {"seen_at": {1: {"step": 0}}}},
         "[I3] swap-1: swap-in 2 overwrote device block 0 having seen step_done at 0"),
        (PREFETCH, {"store1": {"seen_at": {1: {"swap": 0}}}},
         "[I4] store-1: prefetch 1 overwrote host block 10 having seen swap_done at 0"),
    ],
    ids=["I2", "I3", "I4"],
)  # fmt: skip
def test_each_invariant_is_judged_on_rank_1s_own_watermarks(ops, change, expected, tmp_path):
    _, result = replay(build(ops, **change), tmp_path)
    found = messages(result)
    assert [m.split(",")[0] for m in found if not m.startswith("[wait]")] == [expected], found
    assert all("-1: " in m for m in found), found  # nothing at rank 0


def test_a_fence_too_weak_is_one_finding_for_every_rank(tmp_path):
    _, result = replay(build(CLEAN, step1={"fence": {}}), tmp_path)
    assert messages(result) == [
        "[I1] step 1's fence waits for swap 0, but swap-in 1 wrote device block 0 it read "
        "(fence too weak; this run was lucky)"
    ]


def test_an_op_the_engine_applied_though_one_rank_never_completed_it_is_a_violation(tmp_path):
    logs = build(CLEAN, store1={"done_at": [0], "applied": True})
    _, result = replay(logs, tmp_path)
    assert messages(result) == [
        "[ops] the engine applied write-back 1, which store-1 never completed (store-0 did): an "
        "op is complete only once every rank reported it"
    ]
    assert result.violations[0].at is not None
    assert result.violations[0].at.event == "sched.transfer"


def test_an_op_one_rank_has_not_completed_by_the_end_is_in_flight_at_that_rank(tmp_path):
    logs = build(CLEAN, store1={"done_at": [0]})
    _, result = replay(logs, tmp_path)
    assert result.ok, messages(result)
    assert result.in_flight == [
        "write-back 1 (issued, not completed at store-1 by the end of the log)"
    ]


def test_an_op_one_rank_skipped_breaks_that_ranks_lane(tmp_path):
    logs = build(CLEAN)
    del logs.files["swap-1"][logs.find("swap-1", "lane.done", op=1)]
    _, result = replay(logs, tmp_path)
    found = messages(result)
    assert "[lanes] swap-1: swap op 2 completed when op 1 was next: op 1 never completed" in found
    assert "[ops] the engine applied swap-in 1, which swap-1 never completed (swap-0 did): an op " \
        "is complete only once every rank reported it" in found  # fmt: skip
    assert {v.check for v in result.violations} == {"lanes", "ops"}
    assert not any("swap-0:" in m for m in found)


def test_one_rank_completing_an_op_twice_breaks_its_lane_alone(tmp_path):
    logs = build(CLEAN)
    done = logs.find("swap-1", "lane.done", op=1)
    logs.files["swap-1"].insert(done + 1, dict(logs.files["swap-1"][done]))
    _, result = replay(logs, tmp_path)
    assert messages(result) == ["[lanes] swap-1: swap op 1 completed twice"]


def test_the_engine_applying_an_op_before_it_received_a_ranks_report_is_a_violation(tmp_path):
    logs = build(CLEAN)
    lines = logs.files[ENGINE]
    applied = lines.pop(logs.find(ENGINE, "sched.transfer", lane="swap", op=2))
    # swap-1's report of swap op 2 is the second message on its ring to the engine
    lines.insert(logs.find(ENGINE, "msg.recv", peer="swap-1", seq=2), applied)
    _, result = replay(logs, tmp_path)
    assert messages(result) == [
        "[ops] the engine applied swap-out 2 before it received swap-1's report of it"
    ]


def _restart_worker_ranks(logs: Logs) -> None:
    """Every Worker rank dies and restarts as one group; the engine resets its tier once."""
    for rank in logs.ranks:
        logs.pid[f"worker-{rank}"] += 50
        logs.log(f"worker-{rank}", "worker.ready", step_done=1)
    logs.epoch += 1
    logs.log(
        ENGINE, "engine.tier_reset", level="warning", incarnation=2, new_epoch=logs.epoch,
        step_done=1, requeued=["r1"],
    )  # fmt: skip


@pytest.mark.parametrize("stale_at", [None, 1])
def test_after_the_worker_ranks_restart_together_no_rank_runs_a_step_of_the_old_epoch(
    stale_at, tmp_path
):
    logs = build(CLEAN[:2])
    _restart_worker_ranks(logs)
    logs.op("swap", 2, fence={"step": 1}, direction="in", device=[0], host=[12])
    logs.op("step", 2, fence={"swap": 2}, pieces=[[0, 0, 5, True, [0, 1]]])
    if stale_at is not None:
        source = f"worker-{stale_at}"
        logs.files[source][logs.find(source, "step.done", step=2)]["plan_epoch"] = 0
    _, result = replay(logs, tmp_path)
    if stale_at is None:
        assert result.ok, messages(result)
    else:
        assert messages(result) == [
            "[epochs] worker-1 ran step 2 of epoch 0 in epoch 1: a plan for a device tier "
            "since reset"
        ]


def test_the_trace_joins_fences_rank_by_rank_and_marks_what_a_rank_never_completed(tmp_path):
    logs = build(CLEAN, store1={"done_at": [0]})
    log, _ = replay(logs, tmp_path / "run")
    path = tmp_path / "trace.json"
    write_trace(log, path)
    events = orjson.loads(path.read_bytes())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    starts = {e["id"]: names[e["pid"]] for e in events if e["ph"] == "s"}
    ends = {e["id"]: names[e["pid"]] for e in events if e["ph"] == "f"}
    pairs = sorted((starts[i], ends[i]) for i in starts)
    assert pairs == [  # step 1 waits on swap 1, swap 2 on step 1, store 1 on swap 2
        ("swap-0", "store-0"), ("swap-0", "worker-0"), ("swap-1", "worker-1"),
        ("worker-0", "swap-0"), ("worker-1", "swap-1"),
    ]  # fmt: skip
    (lost,) = [e for e in events if "never completed" in e["name"]]
    assert lost["name"] == "write-back 1 never completed" and names[lost["pid"]] == "store-1"


@pytest.mark.parametrize(("applied_as", "ok"), [("failed", True), ("ok", False)])
def test_an_op_whose_ranks_differ_is_applied_with_the_worst_status(applied_as, ok, tmp_path):
    logs = build(CLEAN)
    logs.files["store-1"][logs.find("store-1", "lane.done", op=1)]["status"] = "failed"
    logs.files[ENGINE][logs.find(ENGINE, "sched.transfer", lane="store", op=1)]["status"] = (
        applied_as
    )
    _, result = replay(logs, tmp_path)
    assert messages(result) == (
        [] if ok else ["[ops] the engine applied write-back 1 as ok; its executors reported failed"]
    )

"""``ringfence replay``: each protocol check on a synthetic history, the log reader's
edge cases, the command's exit status and report (--redrive on real runs: test_replay_runs)."""

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
from ringfence.runtime.cli import main as cli

OpSpec = tuple[str, int, dict[str, Any]]

# A swap-in fills device block 0 from host 10; step 1 reads it (and writes block 1); a
# swap-out copies block 1 to host 11; a write-back stores host 11. Each fences the last.
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
# step 2 poisons device block 1, which swap-out 2 copies to host
POISON = [
    *CLEAN[:3],
    ("step", 2, {"fence": {"swap": 2}, "pieces": [[0, 4, 1, True, [0, 2]]], "poison": [1]}),
]
# a prefetch refills host block 10, which swap-in 1 copies to the device
PREFETCH = [CLEAN[0], ("store", 1, {"fence": {"swap": 1}, "direction": "read", "host": [10]})]


def build(ops: list[OpSpec], **changes: Any) -> Logs:
    """Request r1 arrives, the ops run one after another, r1 finishes. ``changes``:
    ``"<lane><number>"`` -> keyword arguments replacing that op's."""
    logs = Logs()
    logs.arrive("r1")
    for lane, number, kwargs in ops:
        logs.op(lane, number, **(kwargs | changes.get(f"{lane}{number}", {})))
    logs.finish("r1")
    return logs


def replay(logs: Logs, run_dir: Path) -> tuple[RunLog, CheckResult]:
    log = read_run(logs.write(run_dir))
    return log, check_run(log)


def failed(result: CheckResult) -> set[str]:
    return {v.check for v in result.violations}


def messages(result: CheckResult) -> list[str]:
    return [f"[{v.check}] {v.message}" for v in result.violations]


@pytest.mark.parametrize(
    "ops", [CLEAN, REFILL, POISON, PREFETCH], ids=["clean", "refill", "poison", "prefetch"]
)
def test_a_clean_history_holds_every_check(ops, tmp_path):
    log, result = replay(build(ops), tmp_path)
    assert log.traced and not log.warnings
    assert result.ok, messages(result)
    assert not result.skipped and result.in_flight == []
    assert result.counts["I1-I4 ops"] == len(ops) and result.counts["rings"] > 0
    assert result.counts["requests"] == 2


SEEN = "having seen"
WEAK = "(fence too weak; this run was lucky)"


@pytest.mark.parametrize(
    ("ops", "change", "expected", "message"),
    [
        (CLEAN, {"step1": {"seen": {"swap": 0}}}, {"I1", "wait"},
         "step 1 read device block 0 having seen swap_done at 0, before swap-in 1 (which wrote"),
        (CLEAN, {"step1": {"fence": {}}}, {"I1"}, f"swap-in 1 wrote device block 0 it read {WEAK}"),
        (CLEAN, {"swap2": {"seen": {"step": 0}}}, {"I2", "wait"},
         "swap-out 2 read device block 1 having seen step_done at 0, before step 1 (which"),
        (CLEAN, {"swap2": {"fence": {}}}, {"I2"}, f"step 1 wrote device block 1 it read {WEAK}"),
        (REFILL, {"swap2": {"seen": {"step": 0}}}, {"I3", "wait"},
         "swap-in 2 overwrote device block 0 having seen step_done at 0, before step 1 (which"),
        (REFILL, {"swap2": {"fence": {}}}, {"I3"},
         f"step 1 used device block 0 it overwrote {WEAK}"),
        (POISON, {"step2": {"seen": {"swap": 1}}}, {"I3", "wait"},
         "step 2 overwrote device block 1 having seen swap_done at 1, before swap-out 2 (which"),
        (POISON, {"step2": {"fence": {"swap": 1}}}, {"I3"},
         f"fence waits for swap 1, but swap-out 2 used device block 1 it overwrote {WEAK}"),
        (CLEAN, {"store1": {"seen": {"swap": 1}}}, {"I4", "wait"},
         "write-back 1 read host block 11 having seen swap_done at 1, before swap-out 2 (which"),
        (CLEAN, {"store1": {"fence": {"swap": 1}}}, {"I4"},
         f"swap-out 2 wrote host block 11 it read {WEAK}"),
        (PREFETCH, {"store1": {"seen": {"swap": 0}}}, {"I4", "wait"},
         "prefetch 1 overwrote host block 10 having seen swap_done at 0, before swap-in 1 (which"),
        (PREFETCH, {"store1": {"fence": {}}}, {"I4"},
         f"swap-in 1 used host block 10 it overwrote {WEAK}"),
    ],
    ids=[
        "I1", "I1-weak-fence", "I2", "I2-weak-fence", "I3-refill", "I3-refill-weak-fence",
        "I3-poison", "I3-poison-weak-fence", "I4-write-back", "I4-write-back-weak-fence",
        "I4-prefetch", "I4-prefetch-weak-fence",
    ],
)  # fmt: skip
def test_an_invariant_broken_or_only_luckily_kept_is_reported(
    ops, change, expected, message, tmp_path
):
    _, result = replay(build(ops, **change), tmp_path)
    assert failed(result) == expected, messages(result)
    (invariant,) = [v for v in result.violations if v.check != "wait"]
    assert message in invariant.message
    assert (SEEN in invariant.message) == ("wait" in expected)  # really broken, or lucky
    assert invariant.at is not None and invariant.at.event in {"step.done", "lane.done", "op.issue"}


def test_a_step_appending_to_a_partial_block_before_its_swap_in_breaks_i1(tmp_path):
    ops: list[OpSpec] = [
        ("swap", 1, {"direction": "in", "device": [0], "host": [10]}),  # positions 0-1
        ("step", 1, {"fence": {"swap": 1}, "pieces": [[0, 2, 1, True, [0]]]}),  # attends 0-1
    ]
    assert replay(build(ops), tmp_path / "clean")[1].ok
    _, result = replay(build(ops, step1={"seen": {"swap": 0}}), tmp_path / "broken")
    assert failed(result) == {"I1", "wait"}, messages(result)


@pytest.mark.parametrize("unapplied", [False, True], ids=["applied", "not-applied"])
def test_a_missing_completion_breaks_the_lane_and_the_op(unapplied, tmp_path):
    logs = build(CLEAN)
    del logs.files["swap-0"][logs.find("swap-0", "lane.done", op=1)]
    if unapplied:
        del logs.files[ENGINE][logs.find(ENGINE, "sched.transfer", lane="swap", op=1)]
    _, result = replay(logs, tmp_path)
    assert failed(result) == {"lanes", "ops"}, messages(result)
    text = "\n".join(messages(result))
    assert "[lanes] swap-0: swap op 2 completed when op 1 was next: op 1 never completed" in text
    if unapplied:
        assert "[ops] swap-0: swap-in 1 never completed, though swap op 2 did" in text
    else:
        assert "[ops] the engine applied swap-in 1, which swap-0 never completed" in text


@pytest.mark.parametrize("restarted", [True, False], ids=["restarted", "not restarted"])
def test_a_lane_restarted_in_its_own_process_may_get_its_last_message_again(restarted, tmp_path):
    # A hosted lane (runtime/hosting.py) restarts on a thread of the same process: its pid
    # stays, and its log says where its next incarnation began.
    logs = build(CLEAN)
    lines = logs.files["swap-0"]
    first = logs.find("swap-0", "msg.recv", peer=ENGINE, seq=1)
    lines.insert(first + 1, dict(lines[first]))
    if restarted:
        start = {k: v for k, v in lines[first].items() if k not in ("peer", "seq")}
        lines.insert(first + 1, {**start, "event": "actor.start", "incarnation": 2})
        lines.insert(0, {**start, "event": "actor.start", "incarnation": 1})
    _, result = replay(logs, tmp_path)
    again = "[rings] swap-0 received from engine-0: sequence number 1 again (after 1)"
    assert messages(result) == ([] if restarted else [again])


def test_an_op_completed_twice_by_one_executor_breaks_its_lane(tmp_path):
    logs = build(CLEAN)
    done = logs.find("swap-0", "lane.done", op=1)
    logs.files["swap-0"].insert(done + 1, dict(logs.files["swap-0"][done]))
    _, result = replay(logs, tmp_path)
    assert messages(result) == ["[lanes] swap-0: swap op 1 completed twice"]


def _ring_edit(logs: Logs, edit: str) -> None:
    """The engine receives swap-0's two results (seq 1, 2); edit that ring's receiving end."""
    lines = logs.files[ENGINE]
    first = logs.find(ENGINE, "msg.recv", peer="swap-0", seq=1)
    if edit == "gap":
        del lines[first]
    else:
        lines.insert(first + 1, dict(lines[first]))
    if edit == "restart":  # the receiving end restarted and got its last message again
        for line in lines[first + 1 :]:
            if line["event"] == "msg.recv":  # (the rest of a restarted engine resyncs)
                line["pid"] += 1


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        ("duplicate", "engine-0 received from swap-0: sequence number 1 again (after 1)"),
        ("gap", "engine-0 received from swap-0: sequence number 2 when 1 was next (a gap)"),
        ("restart", None),
    ],
)
def test_ring_sequence_numbers(edit, expected, tmp_path):
    logs = build(CLEAN)
    _ring_edit(logs, edit)
    _, result = replay(logs, tmp_path)
    assert result.counts["rings"] > 0
    assert messages(result) == ([f"[rings] {expected}"] if expected else [])


@pytest.mark.parametrize(
    ("source", "event", "match", "field", "expected"),
    [
        (ENGINE, "sched.step", {"step": 1}, "msg_epoch",
         "the engine (epoch 0) applied step op 1's completion of epoch 1"),
        (ENGINE, "sched.transfer", {"op": 2}, "msg_epoch",
         "the engine (epoch 0) applied swap op 2's completion of epoch 1"),
        ("worker-0", "step.done", {"step": 1}, "epoch",
         "worker-0 ran step 1 of epoch 0 in epoch 1: a plan for a device tier since reset"),
    ],
    ids=["sched.step", "sched.transfer", "step.done"],
)  # fmt: skip
def test_a_result_of_another_epoch_applied(source, event, match, field, expected, tmp_path):
    logs = build(CLEAN)
    logs.files[source][logs.find(source, event, **match)][field] = 1
    _, result = replay(logs, tmp_path)
    assert messages(result) == [f"[epochs] {expected}"]


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        ("finish twice", "request r1 finished twice"),
        ("arrive twice", "request r1 arrived twice"),
        ("never arrived", "request r1 finished but never arrived"),
        ("never finished", None),
    ],
)
def test_requests_end_once(edit, expected, tmp_path):
    logs = build(CLEAN)
    lines = logs.files[ENGINE]
    event = "request.finish" if "finish" in edit else "request.arrive"
    at = logs.find(ENGINE, event)
    if "twice" in edit:
        lines.insert(at + 1, dict(lines[at]))
    else:
        del lines[at]
    _, result = replay(logs, tmp_path)
    assert messages(result) == ([f"[requests] {expected}"] if expected else [])
    open_requests = [x for x in result.in_flight if x.startswith("request")]
    assert open_requests == (["request r1 (arrived, not finished)"] if expected is None else [])


def test_a_partial_last_line_and_a_line_not_json_are_skipped_with_a_warning(tmp_path):
    logs = build(CLEAN)
    total = sum(len(lines) for lines in logs.files.values())
    run_dir = logs.write(tmp_path)
    engine = run_dir / f"{ENGINE}.jsonl"
    lines = engine.read_bytes().split(b"\n")
    engine.write_bytes(b"\n".join([*lines[:3], b"{not json", *lines[3:]]))
    worker = run_dir / "worker-0.jsonl"
    last = logs.files["worker-0"][-1] | {"status": "failed"}  # a torn line, never read
    worker.write_bytes(worker.read_bytes() + orjson.dumps(last)[:-9])
    log = read_run(run_dir)
    assert len(log.history) == total  # every whole line, nothing else
    assert [w.split(":")[:2] for w in log.warnings] == [
        [f"{ENGINE}.jsonl", "4"],
        ["worker-0.jsonl", str(len(logs.files["worker-0"]) + 1)],
    ]
    assert "not JSON" in log.warnings[0] and "partial last line skipped" in log.warnings[1]
    assert check_run(log).ok


def test_a_killed_run_leaves_ops_and_requests_in_flight_not_violated(tmp_path):
    logs = build(CLEAN)
    del logs.files[ENGINE][logs.find(ENGINE, "request.finish") :]
    logs.op("step", 2, fence={"swap": 2}, pieces=[[0, 5, 1, True, [0, 1]]], done=False)
    logs.op("store", 2, fence={"swap": 2}, direction="write", host=[11], done=False)
    _, result = replay(logs, tmp_path)
    assert result.ok, messages(result)
    assert result.in_flight == [
        "step 2 (issued, not completed by the end of the log)",
        "write-back 2 (issued, not completed by the end of the log)",
        "request r1 (arrived, not finished)",
    ]


def test_only_the_last_launch_on_a_run_dir_is_replayed(tmp_path):
    logs = build(CLEAN, step1={"seen": {"swap": 0}})  # the first launch broke I1
    first = sum(len(lines) for lines in logs.files.values())
    logs.launch()
    logs.arrive("r1")
    for lane, number, kwargs in CLEAN:
        logs.op(lane, number, **kwargs)
    logs.finish("r1")
    log, result = replay(logs, tmp_path)
    assert result.ok, messages(result)
    assert log.warnings == [
        f"2 launches used this run dir; replaying the last (run.start at ts "
        f"{logs.files['supervisor-0'][-1]['ts']})"
    ]
    assert len(log.history) == sum(len(lines) for lines in logs.files.values()) - first
    assert {e.pid for e in log.history} >= {200} and min(e.pid for e in log.history) >= 200


@pytest.mark.parametrize(
    ("change", "quiet", "code", "shown", "hidden"),
    [
        ({}, False, 0, ["  ok   I1 ", "  ok   requests ", "ok: every check holds"], ["FAIL"]),
        ({}, True, 0, ["ok: every check holds"], ["  ok   I1 "]),
        ({"step1": {"seen": {"swap": 0}}}, False, 1,
         ["  FAIL I1 ", "  FAIL wait ", "  ok   I2 ",
          "FAIL: 2 violations; the first:\n  [I1] worker-0: step 1",
          "  [wait] worker-0: step 1 ran having seen swap_done at 0; its fence names swap 1",
          ">> worker-0.jsonl:"], []),
        ({"step1": {"seen": {"swap": 0}}}, True, 1,
         ["FAIL: 2 violations; the first:\n  [I1] worker-0: step 1 read device block 0"],
         ["  ok   I2 "]),
    ],
    ids=["ok", "ok-quiet", "fail", "fail-quiet"],
)  # fmt: skip
def test_the_command_prints_the_verdict_and_exits_0_or_1(
    change, quiet, code, shown, hidden, tmp_path, capsys
):
    run_dir = build(CLEAN, **change).write(tmp_path)
    assert cli(["replay", str(run_dir), *(["--quiet"] if quiet else [])]) == code
    out = capsys.readouterr().out
    assert out.startswith(f"replay {run_dir}: ")
    for text in shown:
        assert text in out
    for text in hidden:
        assert text not in out


@pytest.mark.parametrize("what", ["missing", "empty"])
def test_the_command_exits_2_when_the_run_dir_cannot_be_read(what, tmp_path, capsys):
    run_dir = tmp_path / "run"
    if what == "empty":
        run_dir.mkdir()
        (run_dir / "outputs.jsonl").write_text("{}\n")  # results, not a log
    assert cli(["replay", str(run_dir)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert ("is not a directory" if what == "missing" else "holds no") in captured.err


def test_the_history_follows_the_protocol_not_the_clocks(tmp_path):
    logs = build(CLEAN)
    for line in logs.files["worker-0"] + logs.files["swap-0"]:
        line["ts"] -= 5.0  # these processes' clocks run five seconds behind
    log, result = replay(logs, tmp_path)
    assert result.ok and not log.warnings
    order = {(e.source, e.line): e.order for e in log.history}
    for op in log.ops.values():  # issue, then completion, then application
        assert op.issue is not None and op.done and op.applied
        assert op.issue.order < op.done[0].order < op.applied[0].order
    sends = [e for e in log.history if e.event == "msg.send"]
    receives = {(e.source, e.get("peer"), e.get("seq")): e for e in log.events("msg.recv")}
    paired = 0
    for send in sends:
        receive = receives.get((send.get("peer"), send.source, send.get("seq")))
        if receive is not None:
            assert order[(send.source, send.line)] < receive.order
            paired += 1
    assert paired >= 8


def _new_engine(logs: Logs, first_ops: dict[str, int]) -> None:
    """The engine is killed and restarted: a new process that resynced and began."""
    logs.pid[ENGINE] += 50
    logs.log(ENGINE, "engine.restart", level="warning", incarnation=2)
    logs.log(
        ENGINE, "engine.ready", model_id="m", max_position=64, workload="", first_ops=first_ops
    )


def test_an_engine_that_began_after_its_predecessors_ops_starts_a_fresh_block_record(tmp_path):
    logs = build(CLEAN)
    _new_engine(logs, {"step": 2, "swap": 3, "store": 2})
    logs.arrive("r1")  # a workload's next engine runs its requests again
    # Step 2 overwrites device block 1, which swap-out 2 (of the engine before) read: the
    # resync ordered them, so its fence need not name it.
    logs.op("step", 2, pieces=[[0, 0, 8, True, [0, 1]]])
    logs.finish("r1")
    _, result = replay(logs, tmp_path)
    assert result.ok, messages(result)
    assert result.in_flight == []


def test_an_engine_that_began_before_its_predecessors_ops_were_done_is_reported(tmp_path):
    logs = build(CLEAN)
    _new_engine(logs, {"step": 1, "swap": 3, "store": 2})
    logs.op("step", 2, pieces=[[0, 0, 8, True, [0, 1]]])
    _, result = replay(logs, tmp_path)
    assert "[ops] an engine began with step op 1, but an engine before it had issued step 1" in (
        messages(result)
    )


def test_a_request_in_flight_in_an_engine_that_died_is_reported_unless_run_again(tmp_path):
    logs = Logs()
    logs.arrive("r1")
    lane, number, kwargs = CLEAN[0]
    logs.op(lane, number, **kwargs)
    _new_engine(logs, {"step": 1, "swap": 2, "store": 1})
    logs.log(ENGINE, "engine.stale", level="warning", lane="swap", op=1, msg_epoch=0, why="x")
    _, result = replay(logs, tmp_path)
    assert result.in_flight == ["request r1 (in flight when engine pid 101 ended)"]
    assert "requests" not in failed(result)


def test_after_a_tier_reset_only_completions_of_the_new_epoch_may_be_applied(tmp_path):
    logs = build(CLEAN[:2])
    logs.log(
        ENGINE, "engine.tier_reset", level="warning", incarnation=2, new_epoch=1, step_done=1,
        requeued=["r1"],
    )  # fmt: skip
    logs.op("swap", 2, fence={"step": 1}, direction="out", device=[1], host=[11])  # epoch 0
    logs.epoch = 1
    logs.op("swap", 3, fence={"step": 1}, direction="out", device=[1], host=[12])
    _, result = replay(logs, tmp_path)
    assert messages(result) == [
        "[epochs] the engine (epoch 1) applied swap op 2's completion of epoch 0"
    ]


@pytest.mark.parametrize("stopped", [True, False], ids=["stopped", "killed"])
def test_an_op_executed_but_never_issued_is_a_violation_unless_a_kill_took_the_issue_line(
    stopped, tmp_path
):
    logs = build(CLEAN)
    del logs.files[ENGINE][logs.find(ENGINE, "op.issue", lane="store", op=1)]
    if stopped:  # its log ends cleanly: nothing it wrote was lost
        logs.log(ENGINE, "actor.stop", reason="test", handled=1, failures=0, deferred=0, error=None)
    _, result = replay(logs, tmp_path)
    if stopped:
        assert messages(result) == ["[ops] write-back 1 was executed but never issued"]
    else:
        assert result.ok, messages(result)
        assert result.in_flight == ["write-back 1 (executed; issued by engine pid 101, killed)"]


def test_an_op_whose_engine_was_killed_before_its_completion_came_is_in_flight_saying_so(
    tmp_path,
):
    logs = build(CLEAN)
    del logs.files[ENGINE][logs.find(ENGINE, "sched.transfer", lane="store", op=1)]
    _new_engine(logs, {"step": 2, "swap": 3, "store": 2})
    _, result = replay(logs, tmp_path)
    assert result.ok, messages(result)
    assert result.in_flight == [
        "write-back 1 (completed ok; not applied: engine pid 101, which issued it, was killed)"
    ]


def test_an_op_whose_executor_was_killed_before_its_report_came_is_in_flight_saying_so(
    tmp_path,
):
    logs = build(CLEAN)
    del logs.files[ENGINE][logs.find(ENGINE, "sched.transfer", lane="store", op=1)]
    killed = logs.pid["store-0"]
    logs.pid["store-0"] += 50  # a restarted store lane logs on; the killed one said no stop
    logs.log("store-0", "actor.start")
    _, result = replay(logs, tmp_path)
    assert result.ok, messages(result)
    assert result.in_flight == [
        f"write-back 1 (completed ok; not applied: store-0 pid {killed}, which completed it, "
        "was killed)"
    ]


def test_an_op_completed_but_not_applied_by_a_live_engine_is_in_flight_by_the_end(tmp_path):
    logs = build(CLEAN)
    del logs.files[ENGINE][logs.find(ENGINE, "sched.transfer", lane="store", op=1)]
    _, result = replay(logs, tmp_path)
    assert result.in_flight == ["write-back 1 (completed ok; not applied by the end)"]

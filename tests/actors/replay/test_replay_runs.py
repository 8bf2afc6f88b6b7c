"""``ringfence replay`` on real launched runs: a killed one, hand-corrupted copies of a
finished one (test_engine's pressure x swap run), one with no fence waits, and --redrive.

(Every run of test_engine.py is also replayed and re-driven: see ``finished`` there.)
"""

from __future__ import annotations

import os
import shutil
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
from engine_runs import MODEL, TIERS, TRACE
from launching import QUICK, launched
from replay_logs import ENGINE

from ringfence.actors.replay.checks import check_run
from ringfence.actors.replay.log import read_run
from ringfence.actors.replay.redrive import redrive
from ringfence.runtime.cli import main

PRESSURE = (
    "engine.workload=synthetic:pressure",
    "engine.arrivals=false",
    "cache.device_blocks=48",
    "sched.preemption=swap",
    *MODEL,
    *TIERS,
    TRACE,
    *QUICK,
)


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A traced run SIGKILLed (supervisor and every actor at once) in its 20th step."""
    tmp = tmp_path_factory.mktemp("killed")
    with launched(tmp, *PRESSURE, "engine.requests=4") as run:
        run.wait_for_event("step.done", log="worker-0", step=20, timeout=120)
        pids = [s.pid for s in run.child_stamps()] + [run.proc.pid]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    return run.run_dir


def test_a_killed_run_replays_with_its_open_work_in_flight_and_redrives(killed_run, capsys):
    log = read_run(killed_run)
    result = check_run(log)
    assert result.ok, [v.message for v in result.violations]
    assert log.traced
    assert any(item.startswith("request ") for item in result.in_flight), result.in_flight
    outcome = redrive(log)
    assert outcome.divergence is None, outcome.divergence
    assert outcome.rounds >= 20 and outcome.ops >= 20, outcome
    assert main(["replay", str(killed_run), "--redrive", "--quiet"]) == 0
    assert "redrive ok" in capsys.readouterr().out


def corrupt(source: Path, tmp_path: Path, log: str, pick, change) -> Path:
    """A copy of the run dir whose ``log`` has the first line ``pick`` accepts changed:
    ``change(record)`` returns the lines to put in its place (records or raw bytes)."""
    copy = tmp_path / "copy"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("storage"))
    path = copy / f"{log}.jsonl"
    lines = path.read_bytes().splitlines()
    for i, raw in enumerate(lines):
        record = orjson.loads(raw)
        if pick(record):
            new = [r if isinstance(r, bytes) else orjson.dumps(r) for r in change(record)]
            lines[i : i + 1] = new
            break
    else:
        raise AssertionError(f"no line of {log}.jsonl to corrupt")
    path.write_bytes(b"\n".join(lines) + b"\n")
    return copy


def checks_failed(run_dir: Path) -> Counter[str]:
    return Counter(v.check for v in check_run(read_run(run_dir)).violations)


def test_a_missing_completion_is_reported(pressure_swap_run, tmp_path):
    copy = corrupt(
        pressure_swap_run,
        tmp_path,
        "worker-0",
        lambda r: r["event"] == "step.done" and r["step"] == 20,
        lambda r: [],
    )
    failed = checks_failed(copy)
    assert failed["lanes"] == 1 and failed["ops"] == 1, failed  # applied, never completed


def test_a_duplicate_sequence_number_on_a_ring_is_reported(pressure_swap_run, tmp_path):
    copy = corrupt(
        pressure_swap_run,
        tmp_path,
        "worker-0",
        lambda r: r["event"] == "msg.recv" and r["seq"] == 10,
        lambda r: [r, r],
    )
    assert set(checks_failed(copy)) == {"rings"}


def test_an_old_epoch_result_applied_is_reported(pressure_swap_run, tmp_path):
    copy = corrupt(
        pressure_swap_run,
        tmp_path,
        "engine-0",
        lambda r: r["event"] == "sched.step" and r["step"] == 12,
        lambda r: [{**r, "epoch": r["msg_epoch"] + 1}],  # the engine had moved to a new epoch
    )
    assert set(checks_failed(copy)) == {"epochs"}


def test_a_fence_edited_away_is_too_weak_and_redrive_finds_the_decision(
    pressure_swap_run, tmp_path
):
    copy = corrupt(
        pressure_swap_run,
        tmp_path,
        "engine-0",
        lambda r: r["event"] == "op.issue" and r["lane"] == "step" and r["fence"].get("swap"),
        lambda r: [{**r, "fence": {}}],
    )
    log = read_run(copy)
    failed = Counter(v.check for v in check_run(log).violations)
    assert failed and set(failed) <= {"I1", "I3"}, failed
    divergence = redrive(log).divergence
    assert divergence is not None and "fence" in divergence.message, divergence


def test_a_partial_last_line_is_skipped_with_a_warning(pressure_swap_run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(pressure_swap_run, copy, ignore=shutil.ignore_patterns("storage"))
    with (copy / "swap-0.jsonl").open("ab") as f:
        f.write(b'{"ts":1.0,"event":"lane.do')
    assert main(["replay", str(copy), "--quiet"]) == 0
    assert "partial last line skipped" in capsys.readouterr().err


def test_without_fence_waits_under_chaos_the_broken_invariant_is_named(tmp_path):
    sets = (
        *PRESSURE,
        "engine.requests=3",
        "transfer.skip_fences=true",
        "transfer.chaos_delay_ms=10",
    )
    with launched(tmp_path, *sets) as run:
        run.wait(180)
    result = check_run(read_run(run.run_dir))
    by_check = Counter(v.check for v in result.violations)
    assert by_check["wait"] > 0, by_check
    invariants = [v for v in result.violations if v.check in {"I1", "I2", "I3", "I4"}]
    assert invariants, by_check
    for v in invariants:  # each names the invariant its lanes and tier imply
        executor = v.entries[0].source.split("-")[0]
        if "host block" in v.message:
            assert v.check == "I4", v
        elif executor == "worker":
            assert v.check == ("I1" if " read device" in v.message else "I3"), v
        else:
            assert v.check == ("I2" if " read device" in v.message else "I3"), v


# --redrive on the finished run's logs.


@pytest.fixture
def run_copy(pressure_swap_run, tmp_path) -> Path:
    return Path(
        shutil.copytree(
            pressure_swap_run, tmp_path / "run", ignore=shutil.ignore_patterns("storage")
        )
    )


def edit_engine_line(run_dir: Path, event: str, edit: Any) -> int:
    """Apply ``edit`` to the first ``event`` line of the engine log it returns True for
    (the rest byte for byte as they were); returns that line's number."""
    path = run_dir / f"{ENGINE}.jsonl"
    lines = path.read_bytes().split(b"\n")
    for i, raw in enumerate(lines):
        if f'"event":"{event}"'.encode() in raw:
            data = orjson.loads(raw)
            if edit(data):
                lines[i] = orjson.dumps(data)
                path.write_bytes(b"\n".join(lines))
                return i + 1
    raise LookupError(f"no {event} line to edit")


def _redrive(run_dir: Path) -> Any:
    return redrive(read_run(run_dir))


def test_redrive_repeats_every_decision_of_a_real_run(run_copy, capsys):
    assert main(["replay", str(run_copy), "--redrive", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "ok: every check holds" in out
    assert "redrive ok: the fresh scheduler made every logged decision" in out


def test_redrive_names_the_op_whose_logged_fence_differs(run_copy):
    def stronger_fence(data: dict[str, Any]) -> bool:
        if not data["fence"]:
            return False
        edited.update(lane=data["lane"], op=data["op"], fence=dict(data["fence"]))
        data["fence"] = {lane: n + 1 for lane, n in data["fence"].items()}
        return True

    edited: dict[str, Any] = {}
    number = edit_engine_line(run_copy, "op.issue", stronger_fence)
    divergence = _redrive(run_copy).divergence
    assert divergence is not None
    lane, op = edited["lane"], edited["op"]
    assert divergence.message.startswith(
        f"{lane} op {op}: fence {orjson.dumps(edited['fence']).decode()}; the engine's was "
    )
    assert divergence.message.endswith(f"({ENGINE}.jsonl:{number})")
    assert divergence.entry.event == "sched.schedule" and [lane, op] in divergence.entry.get("ops")


def test_redrive_finds_a_step_result_with_a_token_missing(run_copy):
    def drop_outputs(data: dict[str, Any]) -> bool:
        if data["step"] < 3 or not data["outputs"]:
            return False
        data["outputs"] = []
        return True

    number = edit_engine_line(run_copy, "sched.step", drop_outputs)
    divergence = _redrive(run_copy).divergence
    assert divergence is not None
    # the next round is the first decision the lost token changes
    entry = divergence.entry
    assert entry.event == "sched.schedule" and entry.line > number
    log = read_run(run_copy)
    between = [e.event for e in log.sources[ENGINE] if number < e.line < entry.line]
    assert "sched.schedule" not in between


def test_redrive_finds_a_step_result_with_a_token_changed(run_copy):
    def other_token(data: dict[str, Any]) -> bool:
        if not data["outputs"]:
            return False
        data["outputs"][0][1] += 1
        return True

    number = edit_engine_line(run_copy, "sched.step", other_token)
    divergence = _redrive(run_copy).divergence
    assert divergence is not None
    assert divergence.entry.line == number or divergence.entry.event == "request.finish"

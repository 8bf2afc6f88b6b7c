"""``ringfence replay``'s grammar check (actors/replay/grammar.py) on a traced run of
structured outputs: it passes every token of the run as it came, and flags a token forged
into the engine's log that the request's grammar forbids, naming the request and the place.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import orjson
import pytest
from inproc import inproc_run
from random_workloads import ENGINE, RUN_TIMEOUT_S, outputs
from structured_workloads import check_output, write

from ringfence.actors.replay.checks import check_run
from ringfence.actors.replay.log import read_run

COUNTS = {"json": 3, "regex": 2, "choice": 2}
FORBIDDEN = 0x01  # a control byte: never in compact JSON, not even inside a string


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A traced run of seven constrained requests, every output valid."""
    tmp = tmp_path_factory.mktemp("grammar-replay")
    workload = write(tmp / "workload.jsonl", seed=5, counts=COUNTS)
    sets = (*ENGINE, "runtime.log_level=trace", f"engine.workload={workload}")
    with inproc_run(tmp / "run", sets) as run:
        assert run.wait_shutdown(RUN_TIMEOUT_S * 3), "the workload did not finish"
        assert run.failures() == {}
    for request_id, tokens in outputs(tmp / "run").items():
        check_output(request_id, tokens)
    return tmp / "run"


def test_every_token_of_a_clean_run_passes_the_grammar_check(run_dir):
    result = check_run(read_run(run_dir))
    assert [v for v in result.violations if v.check == "grammar"] == []
    assert result.counts["grammar"] == sum(len(t) for t in outputs(run_dir).values())


def forge(run_dir: Path, into: Path, request_id: str, index: int) -> int:
    """A copy of ``run_dir`` at ``into`` whose engine log gives output token ``index`` of
    ``request_id`` as FORBIDDEN; the token it replaced."""
    shutil.copytree(run_dir, into)
    log = into / "engine-0.jsonl"
    lines = [orjson.loads(line) for line in log.read_bytes().splitlines()]
    [seq_id] = [e["seq_id"] for e in lines if e.get("event") == "request.arrive"
                and e.get("request") == request_id]  # fmt: skip
    seen = 0
    for line in lines:
        if line.get("event") != "sched.step" or line.get("status") != "ok":
            continue
        for pair in line.get("outputs") or ():
            if pair[0] == seq_id:
                if seen == index:
                    replaced, pair[1] = pair[1], FORBIDDEN
                    log.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in lines))
                    return int(replaced)
                seen += 1
    raise AssertionError(f"{request_id} has no output token {index}")


@pytest.mark.parametrize(("request_id", "index"), [("json1", 5), ("regex0", 0), ("choice1", 1)])
def test_a_forged_token_the_grammar_forbids_is_flagged_with_the_request_and_its_place(
    run_dir, tmp_path, request_id, index
):
    replaced = forge(run_dir, tmp_path / "run", request_id, index)
    assert replaced != FORBIDDEN
    result = check_run(read_run(tmp_path / "run"))
    [found] = [v for v in result.violations if v.check == "grammar"]
    assert found.message.startswith(
        f"request {request_id}: output token {index} (id {FORBIDDEN}) is not one its "
        "structured output allowed"
    ), found.message
    assert found.at is not None and found.at.event == "sched.step"

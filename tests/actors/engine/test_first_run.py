"""The main job's workload and limits through the engine.

One launched run (module scope: every test here reads it) of a short ``synthetic:chat``
(2 users, 4 rounds) with pools too small to keep a user's history, beside one request
whose prompt plus max_tokens is past ``sched.max_model_len`` but within the model's
positions: the returning turns find their history on host and in storage, the long
request alone is refused (named under the table; the run exits 1), and the others run to
their end.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from engine_runs import MODEL, replayed, results
from launching import QUICK, launched

from ringfence.actors.config import Config
from ringfence.actors.engine.begin import sched_config
from ringfence.runtime import cli
from ringfence.sched.synthetic import synthetic
from ringfence.sched.workload import WorkloadRequest, parse_workload

MAX_MODEL_LEN = 2040  # the tiny preset has 2,048 positions
CHAT = 8  # requests: 2 users, 4 rounds
LONG_PROMPT = 2030  # plus max_tokens 16: 2,046 tokens, past MAX_MODEL_LEN, within 2,048
SETS = (
    *MODEL,
    *QUICK,
    "cache.device_blocks=116",  # one long turn at a time: the other user's pushes part out
    "cache.host_blocks=16",
    "cache.storage.backend=local",
    f"sched.max_model_len={MAX_MODEL_LEN}",
    # All at once: the scheduler admits in line order, one long turn at a time, so which
    # tier holds what does not hang on the machine's speed.
    "engine.arrivals=false",
)


def workload_line(request: WorkloadRequest) -> dict[str, Any]:
    return {
        "id": request.id,
        "prompt_token_ids": list(request.prompt_token_ids or ()),
        "max_tokens": request.params.max_tokens,
        "seed": request.params.seed,
        "arrival_s": request.arrival_s,
        "session": request.session,
    }


def write_workload(path: Path) -> list[WorkloadRequest]:
    lines = [workload_line(r) for r in synthetic("chat", requests=CHAT)]
    long = {"id": "too-long", "prompt_token_ids": [7] * LONG_PROMPT, "max_tokens": 16}
    lines.append({**long, "arrival_s": 0.2})
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return parse_workload(path.read_bytes().splitlines())


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory) -> tuple[dict[str, dict[str, Any]], dict[str, Any], str]:
    """The run's outputs by id, its summary, and what the command printed."""
    tmp = tmp_path_factory.mktemp("chat")
    write_workload(tmp / "chat.jsonl")
    with launched(tmp, *SETS, f"engine.workload={tmp / 'chat.jsonl'}") as run:
        # The refused request is an error of the run: launch exits 1 once the rest are done.
        assert run.wait(180) == 1, run.tail()
        replayed(run.run_dir)
        outputs, summary = results(run.run_dir)
        printed = run.stdout()
    return {o["id"]: o for o in outputs}, summary, printed


def test_the_returning_turns_of_a_short_chat_find_their_history_on_host_and_in_storage(chat_run):
    outputs, summary, printed = chat_run
    assert summary["cached_tokens"]["host"] > 0 and summary["cached_tokens"]["storage"] > 0
    returning = {i for i, o in outputs.items() if o["returning"]}
    assert returning == {f"chat-u{u}-t{t}" for u in range(2) for t in range(1, 4)}
    turns = summary["ttft_by_turn"]
    assert turns["first"]["requests"] == 2 and turns["returning"]["requests"] == 6
    assert all(turns[t]["p50"] > 0 and turns[t]["p95"] >= turns[t]["p50"] for t in turns)
    assert "TTFT turns   p50/p95: first turns" in printed, printed
    assert "(2 and 6 requests)" in printed, printed


def test_a_request_past_sched_max_model_len_is_refused_alone_naming_the_key_and_numbers(chat_run):
    outputs, summary, _ = chat_run
    refused = outputs["too-long"]
    assert refused["finish_reason"] == "abort" and refused["token_ids"] == []
    assert "is 2046 tokens, more than max_model_len 2040 (sched.max_model_len" in refused["error"]
    assert summary["requests"] == {"total": CHAT + 1, "finished": CHAT, "aborted": 1, "errors": 1}


def test_the_refusal_is_named_under_the_table_and_only_the_chat_counts_as_throughput(chat_run):
    outputs, summary, printed = chat_run
    assert printed.splitlines()[-2] == (
        "1 request refused: a prompt of 2,030 tokens plus max_tokens 16 is 2,046 tokens, "
        "more than max_model_len 2,040 (sched.max_model_len)"
    )
    chat = [o for i, o in outputs.items() if i != "too-long"]
    computed = sum(o["prompt_tokens"] + len(o["token_ids"]) for o in chat)
    rate = summary["throughput"]["total_tokens_per_s"]
    assert rate == pytest.approx(computed / summary["duration_s"])
    assert summary["throughput"]["requests_per_s"] == pytest.approx(CHAT / summary["duration_s"])


def test_beside_the_refused_request_every_chat_turn_runs_to_its_max_tokens(chat_run):
    outputs, _, _ = chat_run
    chat = synthetic("chat", requests=CHAT)
    assert {i: (o["finish_reason"], len(o["token_ids"])) for i, o in outputs.items()} == {
        "too-long": ("abort", 0),
        **{r.id: ("length", r.params.max_tokens) for r in chat},
    }


def test_max_model_len_0_is_the_models_positions_and_a_smaller_one_is_kept():
    assert sched_config(Config.load(None, []), "m", 2048).max_model_len == 2048
    lowered = Config.load(None, ["sched.max_model_len=1000"])
    assert sched_config(lowered, "m", 2048).max_model_len == 1000
    with pytest.raises(ValueError, match=r"^sched.max_model_len is 2049, more than the model's"):
        sched_config(Config.load(None, ["sched.max_model_len=2049"]), "m", 2048)


def test_a_max_model_len_past_the_models_positions_is_a_launch_error_before_any_run(
    tmp_path, capsys
):
    run_dir = tmp_path / "run"
    argv = ["launch", "--run-dir", str(run_dir), "--set", "sched.max_model_len=4096"]
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == (
        "ringfence launch: sched.max_model_len is 4096, more than the model's 2048 positions "
        "(max_position_embeddings); set it to at most that, or 0 for the model's own\n"
    )
    assert not run_dir.exists()

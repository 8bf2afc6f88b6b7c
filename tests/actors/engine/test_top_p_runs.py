"""top_p through a whole run, every actor in this process (inproc.py): from a workload line
and from a client's Submit to the Worker's sampler.

A top_p so small that only the most probable token is left makes a hot sampler greedy; the
same request without it draws other tokens, so a top_p lost on the way fails the run.
"""

from __future__ import annotations

import random
from pathlib import Path

import orjson
from engine_runs import TRACE, replayed
from inproc import inproc_run, wait_until_begun
from random_workloads import ENGINE, RUN_TIMEOUT_S, TIERS, outputs, reference

from ringfence.actors.client.client import Client
from ringfence.actors.replay.log import read_run

HOT = 1.5  # a temperature at which two seeds rarely draw the same 8 tokens
TINY = 1e-9  # a top_p that leaves only the most probable token


def write_lines(path: Path, lines: list[dict[str, object]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path


def test_a_workloads_top_p_reaches_the_worker_and_a_tiny_one_samples_greedily(tmp_path):
    rng = random.Random(7)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(20, 40))] for _ in range(2)]
    lines: list[dict[str, object]] = []
    for i, prompt in enumerate(prompts):
        base = {"prompt_token_ids": prompt, "max_tokens": 8, "seed": i}
        lines += [
            {"id": f"greedy{i}", **base},
            {"id": f"tiny{i}", **base, "temperature": HOT, "top_p": TINY},
            {"id": f"half{i}", **base, "temperature": HOT, "top_p": 0.5},
            {"id": f"hot{i}", **base, "temperature": HOT},
        ]
    workload = write_lines(tmp_path / "workload.jsonl", lines)
    sets = (*ENGINE, *TIERS, TRACE, f"engine.workload={workload}")
    with inproc_run(tmp_path / "run", sets) as run:
        assert run.wait_shutdown(RUN_TIMEOUT_S), "the workload did not finish"
        assert run.failures() == {}
    added = read_run(tmp_path / "run").events("sched.add", source="engine-0")
    assert {e.get("request"): e.get("params")["top_p"] for e in added}["half0"] == 0.5
    replayed(tmp_path / "run")  # the redrive rebuilds each request's params from the log
    got = outputs(tmp_path / "run")
    assert got == reference(workload)  # the plain loop samples each line the same way
    for i in range(len(prompts)):
        assert got[f"tiny{i}"] == got[f"greedy{i}"], i
        assert got[f"hot{i}"] != got[f"greedy{i}"], f"request hot{i} drew the greedy tokens"


def test_a_clients_top_p_reaches_the_worker(tmp_path):
    prompt = [3, 141, 59, 26, 53, 58, 97, 93, 23, 84]
    with (
        inproc_run(tmp_path / "run", (*ENGINE, *TIERS)) as run,
        Client.connect(run.run_dir, stats=True) as client,
    ):
        wait_until_begun(client, RUN_TIMEOUT_S)  # before, a Submit is refused as "starting"
        greedy = client.generate(prompt, max_tokens=8, timeout=RUN_TIMEOUT_S).token_ids
        tiny = [
            client.generate(
                prompt, max_tokens=8, temperature=HOT, top_p=TINY, seed=s, timeout=RUN_TIMEOUT_S
            ).token_ids
            for s in range(3)
        ]
        hot = client.generate(
            prompt, max_tokens=8, temperature=HOT, seed=0, timeout=RUN_TIMEOUT_S
        ).token_ids
        assert run.failures() == {}
    assert tiny == [greedy] * 3
    assert hot != greedy, "the hot request drew the greedy tokens"

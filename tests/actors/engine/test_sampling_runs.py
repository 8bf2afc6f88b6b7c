"""The sampling knobs and logprobs through a whole run, every actor in this process
(inproc.py): from a workload line and a client's Submit to the Worker's sampler and back.

With the host tier, swap preemption and poisoned freed blocks on, every line equals the
plain loop's tokens (which keeps its counts from the start, never preempted), and each knob
changes what it must: a knob lost on the way fails the run.
"""

from __future__ import annotations

import math
from pathlib import Path

import orjson
import torch
from inproc import inproc_run, wait_until_begun
from random_workloads import ENGINE, RUN_TIMEOUT_S, TIERS, outputs, reference

from ringfence.actors.client.client import Client
from ringfence.actors.config import Config
from ringfence.actors.model.loader import load_model

PROMPTS = ([5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 9], [40, 41, 40, 41, 40, 41, 40, 41, 40, 2])


def write_lines(path: Path, lines: list[dict[str, object]]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    return path


def test_a_workloads_penalties_bias_and_min_tokens_reach_the_worker(tmp_path):
    lines: list[dict[str, object]] = []
    for i, prompt in enumerate(PROMPTS):
        base = {"prompt_token_ids": prompt, "max_tokens": 10, "seed": i}
        lines += [
            {"id": f"greedy{i}", **base},
            {"id": f"repetition{i}", **base, "repetition_penalty": 2.0},
            {"id": f"frequency{i}", **base, "frequency_penalty": 2.0},
            {"id": f"presence{i}", **base, "presence_penalty": 2.0},
            {"id": f"bias{i}", **base, "logit_bias": {"77": 100}},
            {"id": f"hot{i}", **base, "temperature": 1.5, "top_k": 3, "min_p": 0.05},
        ]
    workload = write_lines(tmp_path / "workload.jsonl", lines)
    with inproc_run(tmp_path / "run", (*ENGINE, *TIERS, f"engine.workload={workload}")) as run:
        assert run.wait_shutdown(RUN_TIMEOUT_S), "the workload did not finish"
        assert run.failures() == {}
    got = outputs(tmp_path / "run")
    assert got == reference(workload)
    for i in range(len(PROMPTS)):
        assert got[f"bias{i}"] == (77,) * 10
        greedy = got[f"greedy{i}"]
        assert len(set(greedy)) < len(greedy), "the tiny model must repeat itself greedily"
        for knob in ("repetition", "frequency", "presence"):
            assert got[f"{knob}{i}"] != greedy, f"{knob} penalty {i} changed nothing"
        assert len(set(got[f"frequency{i}"])) > len(set(greedy))


def test_min_tokens_holds_off_a_stop_token_and_ignore_eos_is_a_param(tmp_path):
    prompt = list(PROMPTS[0])
    with (
        inproc_run(tmp_path / "run", (*ENGINE, *TIERS)) as run,
        Client.connect(run.run_dir, stats=True) as client,
    ):
        wait_until_begun(client, RUN_TIMEOUT_S)
        greedy = client.generate(prompt, max_tokens=6, timeout=RUN_TIMEOUT_S).token_ids
        stop = greedy[0]
        stopped = client.generate(
            prompt, max_tokens=6, stop_token_ids=[stop], timeout=RUN_TIMEOUT_S
        )
        held = client.generate(
            prompt, max_tokens=6, stop_token_ids=[stop], min_tokens=3, timeout=RUN_TIMEOUT_S
        )
        assert run.failures() == {}
    assert stopped.token_ids == (stop,) and stopped.finish_reason == "stop"
    assert stop not in held.token_ids[:3], "a stop token was sampled before min_tokens"
    assert len(held.token_ids) >= 3


def test_a_clients_logprobs_are_the_models_log_softmax(tmp_path):
    prompt = list(PROMPTS[1])
    with (
        inproc_run(tmp_path / "run", (*ENGINE, *TIERS)) as run,
        Client.connect(run.run_dir, stats=True) as client,
    ):
        wait_until_begun(client, RUN_TIMEOUT_S)
        done = client.generate(prompt, max_tokens=5, logprobs=3, timeout=RUN_TIMEOUT_S)
        plain = client.generate(prompt, max_tokens=5, timeout=RUN_TIMEOUT_S)
        assert run.failures() == {}
    assert plain.logprobs == () and plain.token_ids == done.token_ids
    model, _ = load_model(Config.load(None, list(ENGINE)).model)
    tokens = prompt + list(done.token_ids)
    with torch.inference_mode():
        logits = model.forward_contiguous(torch.tensor(tokens)).to(torch.float64)
    reference = torch.log_softmax(logits, dim=-1)
    assert len(done.logprobs) == len(done.token_ids)
    for i, lp in enumerate(done.logprobs):
        row = reference[len(prompt) - 1 + i]
        best = torch.argsort(row, descending=True, stable=True)[:3].tolist()
        assert lp.token_id == done.token_ids[i] and lp.rank == 1  # greedy: the best one
        assert math.isclose(lp.logprob, float(row[lp.token_id]), abs_tol=1e-9), i
        assert [t for t, _ in lp.top] == best
        for t, value in lp.top:
            assert math.isclose(value, float(row[t]), abs_tol=1e-9)


def test_prompt_logprobs_cover_every_prompt_token_in_chunks_cached_and_for_one_token(tmp_path):
    prompt = list(PROMPTS[0])  # 13 tokens: prefilled in chunks of at most 5
    sets = (*ENGINE, *TIERS, "sched.max_batched_tokens=5")
    with (
        inproc_run(tmp_path / "run", sets) as run,
        Client.connect(run.run_dir, stats=True) as client,
    ):
        wait_until_begun(client, RUN_TIMEOUT_S)
        client.generate(prompt, max_tokens=2, timeout=RUN_TIMEOUT_S)  # its blocks are cached now
        # The last ends on its first token: it leaves the scheduler in the step that
        # brings its prompt's last log probabilities.
        done = [
            client.generate(prompt, max_tokens=n, prompt_logprobs=2, timeout=RUN_TIMEOUT_S)
            for n in (2, 2, 1)
        ]
        assert run.failures() == {}
    model, _ = load_model(Config.load(None, list(ENGINE)).model)
    with torch.inference_mode():
        logits = model.forward_contiguous(torch.tensor(prompt)).to(torch.float64)
    reference = torch.log_softmax(logits, dim=-1)
    for answer in done:
        assert [lp.token_id for lp in answer.prompt_logprobs] == prompt[1:]
        for q, lp in enumerate(answer.prompt_logprobs, start=1):
            row = reference[q - 1]
            assert math.isclose(lp.logprob, float(row[prompt[q]]), abs_tol=1e-9), q
            assert lp.rank == 1 + int((row > row[prompt[q]]).sum())
            assert [t for t, _ in lp.top] == torch.argsort(row, descending=True, stable=True)[
                :2
            ].tolist()
        assert answer.logprobs == (), "prompt_logprobs alone asks nothing of the output"

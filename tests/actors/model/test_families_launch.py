"""Each model family, end to end: ``ringfence launch`` on a transformers checkpoint gives
the greedy tokens of transformers' ``generate()``.

One launch per family: a random-weight float64 checkpoint written by ``save_pretrained``,
a workload file of several requests (a few sharing prefixes), the host and storage
tiers on, a device pool too small for the requests at once (so sequences are swapped
out and back), chaos delays on the transfers and poisoned freed blocks. Every request's
tokens must equal ``generate(do_sample=False)`` of the same checkpoint in transformers,
computed in float64 throughout (see :func:`float64_throughout`); the run must really
have preempted and swapped, and its log must replay.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from engine_runs import MODEL, TIERS, finished
from hf_checkpoints import VOCAB, float64_throughout, save_family
from launching import QUICK, launched

pytest.importorskip("transformers", reason="the reference is transformers")

EOS = 2  # both sides stop at it: the workload names it, and so does generate()
DEVICE_BLOCKS = 12  # of 16 tokens: about four requests' prompts, a quarter of the workload
HOST_BLOCKS = 12  # small enough that the host evicts to storage before the last request
REQUESTS = 7
WEIGHTS_SEED = 11
PROMPTS_SEED = 5
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # most of the 16-dim head's frequencies change
}
# id: (architecture, config overrides)
CHECKPOINTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-rope-llama3": ("LlamaForCausalLM", {"rope_parameters": LLAMA3}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
    # Sequences run to about 130 tokens: a 32-token window hides most of each.
    "mistral-window32": ("MistralForCausalLM", {"sliding_window": 32}),
}


def save_checkpoint(root: Path, checkpoint: str, seed: int) -> Any:
    """The small transformers model of ``checkpoint`` (hf_checkpoints.save_family's
    weights), saved in float64 under ``root``; returned computing in float64 throughout."""
    family, overrides = CHECKPOINTS[checkpoint]
    hf = save_family(root, family, seed=seed, **overrides).to(torch.float64)
    hf.save_pretrained(root)  # again, in float64
    float64_throughout(hf)
    return hf


def workload(seed: int) -> list[dict[str, Any]]:
    """REQUESTS lines of 40-100 prompt tokens; three share a 40-token head, two of them a
    longer one too. Each stops at EOS (as generate() does) or after 16-24 tokens."""
    print(f"prompts seed {seed}")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    head = tokens(40)
    longer = head + tokens(25)
    prompts = [head + tokens(30), longer + tokens(20), longer + tokens(5)]
    prompts += [tokens(rng.randint(40, 100)) for _ in range(REQUESTS - len(prompts) - 1)]
    prompts.append(longer + tokens(12))  # last in: its head may have gone to storage
    return [
        {
            "id": f"r{index}",
            "prompt_token_ids": prompt,
            "max_tokens": rng.randint(16, 24),
            "temperature": 0.0,
            "stop_token_ids": [EOS],
        }
        for index, prompt in enumerate(prompts)
    ]


def generated(hf: Any, lines: list[dict[str, Any]]) -> dict[str, tuple[int, ...]]:
    """transformers' greedy tokens of each line, one generate() per prompt (no padding)."""
    out: dict[str, tuple[int, ...]] = {}
    with torch.inference_mode():
        for line in lines:
            ids = torch.tensor([line["prompt_token_ids"]])
            tokens = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=line["max_tokens"],
                eos_token_id=EOS,
                pad_token_id=EOS,
            )[0, ids.shape[1] :]
            out[line["id"]] = tuple(tokens.tolist())
    return out


# Launched in CI: llama, qwen3 (q/k norms, head_dim) and mistral (the window). qwen2 (qkv
# bias) and llama3 rope scaling are launched with -m slow; in CI their paged logits are
# checked against transformers in-process (test_families.py), each launch costing ~13 s.
SLOW = {"llama-rope-llama3", "qwen2"}


@pytest.mark.parametrize(
    "checkpoint",
    [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CHECKPOINTS],
)
def test_a_launched_checkpoint_of_each_family_gives_the_greedy_tokens_of_transformers(
    tmp_path: Path, checkpoint: str
) -> None:
    print(f"weights seed {WEIGHTS_SEED}")
    hf = save_checkpoint(tmp_path / "checkpoint", checkpoint, WEIGHTS_SEED)
    lines = workload(PROMPTS_SEED)
    path = tmp_path / "workload.jsonl"
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines))
    sets = (
        *MODEL,
        f"model.path={tmp_path / 'checkpoint'}",
        f"engine.workload={path}",
        "engine.arrivals=false",
        f"cache.device_blocks={DEVICE_BLOCKS}",
        "sched.preemption=swap",
        "runtime.log_level=trace",
        *TIERS,
        f"cache.host_blocks={HOST_BLOCKS}",
        *QUICK,
    )
    with launched(tmp_path, *sets) as run:
        expected = generated(hf, lines)  # while the actors start
        outputs, summary = finished(run)
    assert {o["id"]: tuple(o["token_ids"]) for o in outputs} == expected
    assert len({tokens[:4] for tokens in expected.values()}) == len(lines)  # weights not trivial
    engine = summary["engine"]
    # The pool is far too small for every request at once: sequences were swapped out and in.
    assert sum(engine["preemptions"].values()) > 0, engine
    assert engine["blocks"].get("swap_out", 0) > 0, engine
    assert engine["blocks"].get("swap_in", 0) > 0, engine
    # And the lower tiers served prefixes (storage: the last request's head, in this workload).
    print(f"{checkpoint}: cached tokens {summary['cached_tokens']}, engine {engine}")
    assert summary["cached_tokens"]["host"] + summary["cached_tokens"]["storage"] > 0, summary
    if "sliding_window" in CHECKPOINTS[checkpoint][1]:
        hf.config.sliding_window = None  # the window mattered: without it, other tokens
        assert generated(hf, lines[:2]) != {line["id"]: expected[line["id"]] for line in lines[:2]}

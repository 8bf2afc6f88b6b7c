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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from engine_runs import MODEL, TIERS, finished
from launching import QUICK, launched

transformers = pytest.importorskip("transformers", reason="the reference is transformers")

SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 300,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
EOS = 2
DEVICE_BLOCKS = 12  # of 16 tokens: about four requests' prompts, a quarter of the workload
HOST_BLOCKS = 12  # small enough that the host evicts to storage before the last request
REQUESTS = 7
WEIGHTS_SEED = 11
PROMPTS_SEED = 5

# family id: (transformers config class, model class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
}


def save_checkpoint(root: Path, family: str, seed: int) -> Any:
    """A transformers model of ``family`` with seeded random float64 weights, saved under
    ``root`` by ``save_pretrained``; returned in eval mode."""
    config_class, model_class, overrides = FAMILIES[family]
    config = getattr(transformers, config_class)(**{**SHAPE, **overrides})
    torch.manual_seed(seed)
    hf = getattr(transformers, model_class)(config).to(torch.float64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float64)
            param.copy_(1 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise)
    hf.save_pretrained(root)
    return hf.eval()


@contextmanager
def float64_throughout(hf: Any) -> Iterator[None]:
    """Make transformers compute in float64 where it forces float32 in a float64 model.

    Its rotary frequencies and tables and its RMSNorm statistics are float32 in every
    family; ours follow the dtype. The rope functions (default, linear, llama3, ...)
    name ``torch.float`` for their dtype, so the frequencies are recomputed by the
    family's own function with that name meaning float64 for the call.
    """
    patched: list[Any] = []
    for module in hf.modules():
        kind = type(module).__name__
        if kind.endswith("RotaryEmbedding"):
            module.forward = _rotary(module)
        elif kind.endswith("RMSNorm"):
            module.forward = _norm(module)
        else:
            continue
        patched.append(module)
    assert patched, "no rotary embedding or RMSNorm found to patch"
    try:
        yield
    finally:
        for module in patched:
            del module.forward


def _rotary(module: Any) -> Any:
    if module.rope_type == "default":
        init = type(module).compute_default_rope_parameters
    else:
        init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[module.rope_type]
    single = torch.float
    torch.float = torch.float64  # type: ignore[misc]
    try:
        inv_freq, scaling = init(module.config)
    finally:
        torch.float = single  # type: ignore[misc]
    assert inv_freq.dtype == torch.float64, inv_freq.dtype

    def forward(x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids[..., None].to(torch.float64) * inv_freq
        angles = torch.cat((angles, angles), dim=-1)
        return (angles.cos() * scaling).to(x.dtype), (angles.sin() * scaling).to(x.dtype)

    return forward


def _norm(module: Any) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
        scaled: torch.Tensor = module.weight * (x * scale)
        return scaled

    return forward


def workload(seed: int) -> list[dict[str, Any]]:
    """REQUESTS lines of 40-100 prompt tokens; three share a 40-token head, two of them a
    longer one too. Each stops at EOS (as generate() does) or after 16-24 tokens."""
    print(f"prompts seed {seed}")
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(n)]

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
    with float64_throughout(hf), torch.no_grad():
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


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_launched_checkpoint_of_each_family_gives_the_greedy_tokens_of_transformers(
    tmp_path: Path, family: str
) -> None:
    print(f"weights seed {WEIGHTS_SEED}")
    hf = save_checkpoint(tmp_path / "checkpoint", family, WEIGHTS_SEED)
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
        outputs, summary = finished(run)
    expected = generated(hf, lines)
    assert {o["id"]: tuple(o["token_ids"]) for o in outputs} == expected
    assert len({tokens[:4] for tokens in expected.values()}) == len(lines)  # weights not trivial
    engine = summary["engine"]
    # The pool is far too small for every request at once: sequences were swapped out and in.
    assert sum(engine["preemptions"].values()) > 0, engine
    assert engine["blocks"].get("swap_out", 0) > 0, engine
    assert engine["blocks"].get("swap_in", 0) > 0, engine
    print(f"{family}: summary {orjson.dumps(summary).decode()}")

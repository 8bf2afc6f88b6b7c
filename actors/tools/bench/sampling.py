"""The Worker's sampling cost per decode step, by what the sequences ask for.

Part of ``ringfence bench worker``: the same ``Sampler`` the Worker runs (batched tensor ops
on the logits' device, ``actors/model/sampler.py``), on one decode step's last logits
(``decode_seqs`` rows of the model's vocabulary, float32, on ``device``), for sequences that
ask for nothing (``plain``: greedy, the path every step took before the knobs existed),
for ``logprobs`` 5, for the three penalties over a 256-token history, for those with top_k
(``all``, greedy), for a seeded draw (``hot``), for every knob at once (``every``), and
(``grammar``, given the model's grammars) for a structured output: every row in the middle
of a nested JSON schema (:data:`SCHEMA`, its matcher rebuilt from the output so far as a
reopened sequence's is), masked by llguidance. Each figure is the
median over rounds of ``STEPS`` steps, in milliseconds per step, with its ratio to
``plain`` measured in the same run. A step's time ends when its tokens are on the host (the
sampler's one copy back waits for the device), so on CUDA it is the kernels' time and the
launches', not the launches' alone.

The ``grammar`` figure is the whole cost of a masked step as this bench times it: the
masks filled, then applied, then the draw. In the Worker the fill runs beside the forward
(``actors/executors/constraints.py``), so a step pays the apply and the draw, and the fill
only where it outlasts the forward.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from typing import TYPE_CHECKING, Any

from ringfence.sched.ops import Opening, Piece
from ringfence.sched.sampling import SamplingParams
from ringfence.sched.structured import StructuredOutput

if TYPE_CHECKING:
    from ringfence.actors.text.grammars import Grammars

STEPS = 20  # decode steps per timed round
HISTORY = 256  # tokens each sequence has seen before the step
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    "all": {"logprobs": 5, "repetition_penalty": 1.2, "frequency_penalty": 0.5, "top_k": 50},
    "hot": {"temperature": 0.8, "seed": 1},  # a seeded draw from the whole softmax
    "every": {  # every knob at once, drawn at temperature > 0 (top_k and top_p: one sort)
        "temperature": 0.8, "seed": 1, "top_k": 50, "top_p": 0.9, "min_p": 0.05,
        "repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.5,
        "logit_bias": ((1, 2.0), (2, -2.0)), "min_tokens": HISTORY, "stop_token_ids": (3,),
        "logprobs": 5,
    },
}  # fmt: skip


# The grammar variant's schema, and the output every row stands after (mid-object).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "address", "tags"],
    "additionalProperties": False,
}
OUTPUT_SO_FAR = '{"name": "Ada", "age": 36, "address": {"city": "Lon'


def sampling_costs(
    vocab_size: int,
    seqs: int,
    rounds: int,
    seed: int = 0,
    *,
    grammars: Grammars | None = None,
    encode: Any = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """{variant: ms per step}, {variant: ratio to plain}: see the module docstring. With
    ``grammars`` (the model's) and ``encode`` (its tokenizer's text to ids), the ``grammar``
    variant too. ``device``: where the logits and the sampler's counts are."""
    import torch

    from ringfence.actors.executors.sampling import Sampler

    gen = random.Random(seed)
    history = [[gen.randrange(vocab_size) for _ in range(HISTORY)] for _ in range(seqs)]
    logits = torch.randn(seqs, vocab_size, generator=torch.Generator().manual_seed(seed))
    logits = logits.to(device)
    variants = dict(VARIANTS)
    if grammars is not None:
        spec = StructuredOutput(kind="json", source=json.dumps(SCHEMA))
        variants["grammar"] = {"structured": spec}
        output = list(encode(OUTPUT_SO_FAR))
    ms: dict[str, float] = {}
    for name, knobs in variants.items():
        sampler = Sampler(vocab_size, grammars=grammars, device=device)
        params = SamplingParams(max_tokens=HISTORY, **knobs)
        rows = history
        prompt = HISTORY // 2
        if name == "grammar":  # the prompt, then the output so far: the matcher replays it
            rows = [h[: HISTORY - len(output)] + output for h in history]
            prompt = HISTORY - len(output)
        pieces = [
            Piece(
                seq_id=i, token_ids=(h[-1],), start=HISTORY - 1, block_table=(), sample=True,
                opening=Opening(params=params, num_prompt_tokens=prompt,
                                history=tuple(h[:-1]) if params.needs_history else ()),
            )
            for i, h in enumerate(rows)
        ]  # fmt: skip
        sampler.advance(pieces)
        steps = [[Piece(seq_id=p.seq_id, token_ids=p.token_ids, start=p.start, block_table=(),
                        sample=True) for p in pieces]]  # fmt: skip
        times = []
        for _ in range(rounds + 1):  # the first round warms up
            began = time.perf_counter()
            for _ in range(STEPS):
                sampler.sample(steps[0], logits)
            times.append((time.perf_counter() - began) / STEPS * 1e3)
        ms[name] = statistics.median(times[1:])
    return {"ms_per_step": ms, "ratio_to_plain": {k: v / ms["plain"] for k, v in ms.items()}}

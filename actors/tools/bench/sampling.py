"""The Worker's sampling cost per decode step, by what the sequences ask for.

Part of ``ringfence bench worker``: the same ``Sampler`` the Worker runs, on one decode
step's last logits (``decode_seqs`` rows of the model's vocabulary), for sequences that
ask for nothing beyond temperature (``plain``: the path every step took before the
knobs existed), for ``logprobs`` 5, for the three penalties over a 256-token history,
and for all of them. Each figure is the median over rounds of ``STEPS`` steps, in
milliseconds per step, with its ratio to ``plain`` measured in the same run.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from ringfence.sched.ops import Opening, Piece
from ringfence.sched.sampling import SamplingParams

STEPS = 20  # decode steps per timed round
HISTORY = 256  # tokens each sequence has seen before the step
VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.5},
    "all": {"logprobs": 5, "repetition_penalty": 1.2, "frequency_penalty": 0.5, "top_k": 50},
}


def sampling_costs(vocab_size: int, seqs: int, rounds: int, seed: int = 0) -> dict[str, Any]:
    """{variant: ms per step}, {variant: ratio to plain}: see the module docstring."""
    import torch

    from ringfence.actors.executors.sampling import Sampler

    gen = random.Random(seed)
    history = [[gen.randrange(vocab_size) for _ in range(HISTORY)] for _ in range(seqs)]
    logits = torch.randn(seqs, vocab_size, generator=torch.Generator().manual_seed(seed))
    ms: dict[str, float] = {}
    for name, knobs in VARIANTS.items():
        sampler = Sampler(vocab_size)
        params = SamplingParams(max_tokens=HISTORY, **knobs)
        pieces = [
            Piece(
                seq_id=i, token_ids=(h[-1],), start=HISTORY - 1, block_table=(), sample=True,
                opening=Opening(params=params, num_prompt_tokens=HISTORY // 2,
                                history=tuple(h[:-1]) if params.needs_counts else ()),
            )
            for i, h in enumerate(history)
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

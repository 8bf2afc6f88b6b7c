"""The Worker's sampler with grammars (issue 38), on the byte tokenizer and random logits:
every draw is one the grammar allows, a sequence reopened with its history masks as one
never closed, and a sequence without a grammar starts no mask work."""

from __future__ import annotations

import torch

from ringfence.actors.executors.sampling import Sampler
from ringfence.actors.text.grammars import model_grammars
from ringfence.actors.text.tokenizer import EOS, VOCAB_SIZE, ByteTokenizer
from ringfence.sched.ops import Opening, Piece
from ringfence.sched.sampling import SamplingParams
from ringfence.sched.structured import StructuredOutput

PROMPT = (1, 2, 3)
CHOICE = StructuredOutput.choice(["alpha", "beta", "gamma"])


def sampler() -> Sampler:
    return Sampler(VOCAB_SIZE, grammars=model_grammars("", VOCAB_SIZE))


def piece(tokens: tuple[int, ...], start: int, opening: Opening | None = None) -> Piece:
    return Piece(seq_id=7, token_ids=tokens, start=start, block_table=(), sample=True,
                 opening=opening)  # fmt: skip


def logits(step: int) -> torch.Tensor:
    return torch.randn((1, VOCAB_SIZE), generator=torch.Generator().manual_seed(step))


def generate(params: SamplingParams, *, reopen_at: int = -1, limit: int = 12) -> list[int]:
    """Greedy draws over random logits until EOS; at output length ``reopen_at`` the
    sequence is opened again from its history (as after a preemption or a restart)."""
    s = sampler()
    out: list[int] = []
    step = piece(PROMPT, 0, Opening(params=params, num_prompt_tokens=len(PROMPT)))
    while len(out) < limit:
        s.advance([step])
        [token] = s.sample([step], logits(len(out)))
        out.append(token.token_id)
        if token.token_id == EOS:
            break
        start = len(PROMPT) + len(out) - 1
        if len(out) == reopen_at:
            s = sampler()  # a restarted Worker: nothing kept
            history = PROMPT + tuple(out[:-1])
            opening = Opening(params=params, num_prompt_tokens=len(PROMPT), history=history)
            step = piece((out[-1],), start, opening)
        else:
            step = piece((out[-1],), start)
    return out


def test_every_draw_is_one_the_grammar_allows_and_the_output_ends_at_eos():
    out = generate(SamplingParams(structured=CHOICE))
    assert out[-1] == EOS
    assert ByteTokenizer().decode(out) in ("alpha", "beta", "gamma")


def test_a_sequence_reopened_from_its_history_draws_what_an_unbroken_one_does():
    params = SamplingParams(structured=StructuredOutput(kind="regex", source="[a-f]{3,8}"))
    unbroken = generate(params)
    for at in (1, 2, 4):
        assert generate(params, reopen_at=at) == unbroken, at


def test_min_tokens_cannot_hold_off_the_end_a_finished_grammar_allows_alone():
    params = SamplingParams(structured=StructuredOutput.choice(["ab"]), min_tokens=6,
                            stop_token_ids=(EOS,))  # fmt: skip
    assert generate(params) == [ord("a"), ord("b"), EOS]


def test_a_step_without_an_open_grammar_starts_no_mask_work():
    s = sampler()
    plain = piece(PROMPT, 0, Opening(params=SamplingParams(), num_prompt_tokens=len(PROMPT)))
    s.advance([plain])
    assert s.start_masks([plain]) is None
    assert s.constraints is not None and s.constraints._pool is None, "a thread was started"
    constrained = Opening(params=SamplingParams(structured=CHOICE), num_prompt_tokens=3)
    s.advance([piece(PROMPT, 0, constrained)])
    s.close([7])
    assert s.constrained == set() and s.start_masks([plain]) is None

"""The Worker's per-sequence sampling state and the knobs it applies, against references
computed here from the definitions (vLLM's semantics)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from builders import opened

from ringfence.actors.executors.sampling import Sampler, processed, token_logprobs
from ringfence.actors.model.inputs import DeviceInputs
from ringfence.actors.model.reference_sampling import sample
from ringfence.sched.ops import Opening, Piece
from ringfence.sched.sampling import LOGPROB_FLOOR, SamplingParams

VOCAB = 12


def logits_of(seed: int = 0) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def processed_after(
    raw: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int], position: int
) -> torch.Tensor:
    return processed(raw, params, position=position, num_prompt_tokens=len(prompt),
                     output_counts=Counter(output), seen=set(prompt + output))  # fmt: skip


def test_penalties_follow_their_definitions_over_the_prompt_and_the_output() -> None:
    prompt, output = [1, 2, 2], [2, 3, 3, 3]
    params = SamplingParams(
        repetition_penalty=1.5, frequency_penalty=0.25, presence_penalty=0.5, max_tokens=9
    )
    raw = logits_of()
    got = processed_after(raw, params, prompt, output, position=len(prompt) + len(output))
    want = raw.clone()
    for token in (1, 2, 3):  # in the prompt or the output: the repetition penalty
        want[token] = want[token] / 1.5 if want[token] > 0 else want[token] * 1.5
    for token, count in {2: 1, 3: 3}.items():  # in the output only: frequency and presence
        want[token] -= 0.25 * count + 0.5
    assert torch.equal(got, want)
    assert torch.equal(raw, logits_of()), "the raw logits are not changed"


def test_logit_bias_is_added_and_the_stop_tokens_are_masked_until_min_tokens() -> None:
    params = SamplingParams(logit_bias=((4, 100.0), (5, -3.0)), min_tokens=2, stop_token_ids=(7, 8))
    raw = logits_of(1)
    early = processed_after(raw, params, [1, 2], [], position=3)  # too short to stop yet
    assert early[4] == raw[4] + 100.0 and early[5] == raw[5] - 3.0
    assert early[7] == -math.inf and early[8] == -math.inf
    late = processed_after(raw, params, [1, 2], [], position=4)  # two output tokens: it may stop
    assert late[7] == raw[7] and late[8] == raw[8]


def test_top_k_one_and_min_p_one_are_greedy_at_any_temperature() -> None:
    for seed in range(20):
        raw = logits_of(seed)
        best = int(torch.argmax(raw))
        for knobs in ({"top_k": 1}, {"min_p": 1.0}):
            pick = sample(raw, temperature=1.5, seed=seed, position=3, **knobs)  # type: ignore[arg-type]
            assert pick.token_id == best, (seed, knobs)


def test_top_k_draws_only_among_the_k_most_probable() -> None:
    raw = logits_of(2)
    allowed = set(torch.topk(raw, 3).indices.tolist())
    drawn = {sample(raw, temperature=2.0, seed=s, position=0, top_k=3).token_id for s in range(200)}
    assert drawn == allowed


def test_logprobs_list_the_best_alternatives_in_order_with_the_tokens_rank() -> None:
    raw = logits_of(3)
    reference = torch.log_softmax(raw, dim=-1)
    order = torch.argsort(reference, descending=True).tolist()
    logprob, top, rank = token_logprobs(raw, order[2], 4)
    assert logprob == float(reference[order[2]]) and rank == 3
    assert [t for t, _ in top] == order[:4]
    assert [v for _, v in top] == [float(reference[t]) for t in order[:4]]
    masked = raw.clone()
    masked[5] = -math.inf
    assert token_logprobs(masked, 5, 0)[0] == LOGPROB_FLOOR, "no infinity on the wire"


@pytest.mark.parametrize("row", ["distinct", "ties", "masked", "flat"])
def test_the_top_logprobs_are_the_first_k_of_a_stable_sort_of_the_whole_row(row: str) -> None:
    gen = torch.Generator().manual_seed(5)
    for trial in range(40):
        x = torch.randn(300, generator=gen, dtype=torch.float64)
        if row == "ties":
            x = torch.round(x * 2) / 2  # many equal values, at every boundary
        elif row == "masked":
            x[torch.randperm(300, generator=gen)[:290]] = -math.inf
        elif row == "flat":
            x = torch.zeros(300, dtype=torch.float64)
        k = 1 + trial % 20
        values, order = torch.sort(torch.log_softmax(x, dim=-1), descending=True, stable=True)
        first = zip(order[:k].tolist(), values[:k].tolist(), strict=True)
        want = [(i, max(v, LOGPROB_FLOOR)) for i, v in first]
        assert list(token_logprobs(x, 0, k)[1]) == want, (row, trial, k)


def piece(seq_id: int, tokens: list[int], start: int, opening: Opening | None = None) -> Piece:
    return Piece(
        seq_id=seq_id, token_ids=tuple(tokens), start=start, block_table=(0, 1, 2, 3),
        sample=True, opening=opening,
    )  # fmt: skip


def test_an_opened_sequence_counts_its_history_and_every_piece_then_is_forgotten() -> None:
    sampler = Sampler(VOCAB)
    params = SamplingParams(presence_penalty=1.0, max_tokens=8)
    first = piece(1, [3, 4], 2, Opening(params=params, num_prompt_tokens=3, history=(1, 2)))
    assert sampler.problem([first]) == ""
    sampler.advance([first])  # prompt 1 2 3, output 4
    assert sampler.counts_of(1) == ({4: 1}, {1, 2, 3, 4})
    sampler.advance([piece(1, [4], 4)])
    assert sampler.counts_of(1) == ({4: 2}, {1, 2, 3, 4}) and sampler.seqs[1].num_tokens == 5
    slot = sampler.seqs[1].slot
    sampler.close([1, 99])
    assert slot in sampler.counts.free, "its slot is free again"
    assert sampler.seqs == {}
    assert "never opened" in sampler.problem([piece(1, [5], 5)])


def test_tokens_still_on_the_device_are_counted_as_the_same_tokens_on_the_host() -> None:
    # A decode launched before the step before was read back names its input on the device
    # (DeviceInputs): the penalties' counts take it there, as they would from the host.
    params = SamplingParams(presence_penalty=0.5, repetition_penalty=1.2)
    opening = Opening(params=params, num_prompt_tokens=3, history=(1, 2))
    host, device = Sampler(VOCAB), Sampler(VOCAB)
    for sampler in (host, device):
        sampler.advance([piece(1, [3, 4], 2, opening), piece(2, [5], 0, opened(1))])
    host.advance([piece(1, [7], 4), piece(2, [6], 1)])
    drawn = torch.tensor([9, 7])  # a draw's rows: sequence 1 took the second
    device.advance([piece(1, [0], 4), piece(2, [6], 1)], DeviceInputs((0,), drawn[1:]))
    assert device.counts_of(1) == host.counts_of(1) == ({4: 1, 7: 1}, {1, 2, 3, 4, 7})
    assert device.seqs[1].num_tokens == host.seqs[1].num_tokens == 5
    assert device.seqs[2].num_tokens == 2


def test_a_plain_sequence_keeps_no_counts() -> None:
    sampler = Sampler(VOCAB)
    sampler.advance([piece(1, [1, 2, 3], 0, opened(3))])
    assert sampler.seqs[1].slot == 0 and sampler.seqs[1].num_tokens == 3
    assert sampler.counts_of(1) == ({}, set())


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_the_sampled_tokens_logprob_is_of_the_logits_the_mode_names(mode: str) -> None:
    sampler = Sampler(VOCAB, mode)
    params = SamplingParams(logit_bias=((6, 100.0),), logprobs=2)
    sampler.advance([piece(1, [1, 2], 0, Opening(params=params, num_prompt_tokens=2))])
    raw = logits_of(4)
    [out] = sampler.sample([piece(1, [1, 2], 0)], raw.unsqueeze(0))
    assert out.token_id == 6, "a +100 bias wins at temperature 0"
    biased = raw.clone()
    biased[6] += 100.0
    source = raw if mode == "raw_logprobs" else biased
    assert out.logprob == float(torch.log_softmax(source, dim=-1)[6])
    assert len(out.top) == 2


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the Worker's sampling of CUDA logits"
)


@needs_cuda
@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_on_cuda_every_knob_samples_the_tokens_and_logprobs_of_the_cpu_run(mode: str) -> None:
    knobs = SamplingParams(
        temperature=0.8, top_p=0.9, top_k=6, min_p=0.05, seed=7, logprobs=3, min_tokens=3,
        repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
        logit_bias=((2, 1.5), (9, -2.0)), stop_token_ids=(11,),
    )  # fmt: skip
    results = {}
    for device in ("cpu", "cuda"):
        sampler = Sampler(VOCAB, mode, device=device)
        opening = Opening(params=knobs, num_prompt_tokens=3, history=(1, 2, 2))
        tokens: list[int] = [3]
        first = piece(1, tokens, 3, opening)
        sampler.advance([first])
        got = []
        for step in range(12):
            p = first if step == 0 else piece(1, tokens[-1:], 3 + step)
            if step:
                sampler.advance([p])
            [out] = sampler.sample([p], logits_of(step).to(device).unsqueeze(0))
            got.append((out.token_id, out.logprob, out.rank, out.top))
            tokens.append(out.token_id)
        results[device] = got
    assert [g[0] for g in results["cuda"]] == [g[0] for g in results["cpu"]]
    for c, g in zip(results["cpu"], results["cuda"], strict=True):
        assert abs(c[1] - g[1]) < 1e-12 and c[2] == g[2]
        assert [t for t, _ in c[3]] == [t for t, _ in g[3]]

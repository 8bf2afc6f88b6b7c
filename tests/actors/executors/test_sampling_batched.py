"""The batched sampler (``model/sampler.py`` through the Worker's ``Sampler``) equals the
one-row reference (``reference_sampling.sample``, ``sampling.processed``,
``token_logprobs``), row by row, for every knob and their combinations: the exact token,
rank and top ids, the logprobs to 1e-12. The uniform of a draw is the same in tensor ops
and in Python ints, and the penalties' counts on the device are those counted on the
host."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from concurrent.futures import Future

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringfence.actors.executors.constraints import MaskJob, masked
from ringfence.actors.executors.knobs import build_knobs
from ringfence.actors.executors.sampling import NonFiniteLogits, Sampler, processed, token_logprobs
from ringfence.actors.model.draws import as_int64, uniform, uniforms
from ringfence.actors.model.inputs import DeviceInputs
from ringfence.actors.model.reference_sampling import sample
from ringfence.actors.model.sampler import masked_rows, processed_rows
from ringfence.sched.ops import Opening, Piece
from ringfence.sched.sampling import SamplingParams
from ringfence.sched.structured import StructuredOutput

VOCAB = 40
PROMPT = 6  # every sequence's prompt length

knobs = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.sampled_from([0.0, 0.3, 1.0, 2.5]),
        "top_k": st.sampled_from([0, 1, 3, VOCAB - 1, VOCAB, 1000]),
        "top_p": st.sampled_from([1e-9, 0.3, 0.9, 1.0]),
        "min_p": st.sampled_from([0.0, 0.05, 0.5, 1.0]),
        "repetition_penalty": st.sampled_from([1.0, 0.7, 1.5]),
        "frequency_penalty": st.sampled_from([0.0, -1.0, 0.5]),
        "presence_penalty": st.sampled_from([0.0, 0.4, -2.0]),
        "seed": st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 + 5, 10**30]),
        "logit_bias": st.lists(
            st.tuples(st.integers(0, VOCAB - 1), st.sampled_from([-100.0, -2.5, 3.0, 100.0])),
            max_size=3,
        ),
        "min_tokens": st.sampled_from([0, 2, 8]),
        "stop_token_ids": st.lists(st.integers(0, VOCAB - 1), max_size=3).map(tuple),
        "logprobs": st.sampled_from([None, 0, 1, 5, 20]),
    },
)
rows_kind = st.sampled_from(["random", "ties", "flat", "peaked"])
GRAMMAR = StructuredOutput.choice(["a", "b"])  # a grammar; the test gives its masks


def bitmask_of(rows: int, seed: int) -> torch.Tensor:
    """Random grammar masks allowing about 1 token in 5, and the token 1 always (words of
    32 bits, as llguidance fills them)."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, 64, generator=gen) < 0.2
    allowed[:, 1] = True
    weights = torch.tensor([1 << j for j in range(32)], dtype=torch.int64)
    words = (allowed.view(rows, 2, 32).long() * weights).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def logits_of(kind: str, rows: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, VOCAB, generator=gen, dtype=torch.float64)
    if kind == "ties":
        x = torch.round(x * 2) / 2  # many equal values, at every boundary
    elif kind == "flat":
        x = torch.zeros(rows, VOCAB, dtype=torch.float64)
    elif kind == "peaked":
        x = x * 30
    return x


def reference_row(raw, params, *, position, output, seen, mode, bits=None):
    """What the Worker sampled one row by, before it batched: the row's SampledToken
    fields (token, logprob, rank, top)."""
    if bits is not None:
        raw = masked(raw, bits)
    logits = raw
    if params.processes_logits:
        logits = processed(raw, params, position=position, num_prompt_tokens=PROMPT,
                           output_counts=output, seen=seen)  # fmt: skip
        if bits is not None and not bool(logits.isfinite().any()):
            logits = raw  # the knobs forbade every token the grammar allows: it wins
    token = sample(logits, temperature=params.temperature, seed=params.seed, position=position,
                   top_p=params.top_p, top_k=params.top_k, min_p=params.min_p)  # fmt: skip
    logprob, rank = token.logprob, 1
    top: tuple[tuple[int, float], ...] = ()
    if params.logprobs is not None or logits is not raw:
        chosen = raw if mode == "raw_logprobs" else logits
        logprob, top, rank = token_logprobs(chosen, token.token_id, params.logprobs or 0)
    return token.token_id, max(logprob, -9999.0), rank, top


@settings(max_examples=150, deadline=None)
@given(
    params=st.lists(knobs, min_size=1, max_size=6),
    kind=rows_kind,
    mode=st.sampled_from(["raw_logprobs", "processed_logprobs"]),
    seed=st.integers(0, 2**32 - 1),
    outputs=st.integers(0, 10),
    grammar=st.booleans(),
)
def test_the_batched_sampler_equals_the_one_row_reference(
    params, kind, mode, seed, outputs, grammar
):
    print(f"seed {seed}")
    rng = random.Random(seed)
    sampler = Sampler(VOCAB, mode)
    logits = logits_of(kind, len(params), seed)
    bits = bitmask_of(len(params), seed) if grammar else None
    pieces, expected = [], []
    for i, knob in enumerate(params):
        p = SamplingParams(max_tokens=64, structured=GRAMMAR if grammar else None, **knob)
        history = [rng.randrange(VOCAB) for _ in range(PROMPT + outputs)]
        opening = Opening(params=p, num_prompt_tokens=PROMPT, history=tuple(history))
        last = rng.randrange(VOCAB)
        start = len(history)
        pieces.append(Piece(seq_id=10 + i, token_ids=(last,), start=start, block_table=(),
                            sample=True, opening=opening))  # fmt: skip
        output = Counter([*history[PROMPT:], last])
        seen = set(history) | {last}
        if not p.needs_counts:
            output, seen = Counter(), set()
        row_bits = None if bits is None else bits[i]
        expected.append(reference_row(logits[i], p, position=start + 1, output=output,
                                      seen=seen, mode=mode, bits=row_bits))  # fmt: skip
    sampler.advance(pieces)
    masks = None
    if bits is not None:  # every row constrained, its mask already filled
        done: Future[None] = Future()
        done.set_result(None)
        masks = MaskJob(rows={i: i for i in range(len(params))}, bits=bits, done=done)
    got = sampler.sample(pieces, logits, masks)
    for i, (out, want) in enumerate(zip(got, expected, strict=True)):
        assert (out.token_id, out.rank) == (want[0], want[2]), (i, params[i])
        assert abs(out.logprob - want[1]) <= 1e-12, (i, params[i])
        assert [t for t, _ in out.top] == [t for t, _ in want[3]], (i, params[i])
        for (_, a), (_, b) in zip(out.top, want[3], strict=True):
            assert abs(a - b) <= 1e-12


@pytest.mark.parametrize("third", ["top_p alone", "top_k and top_p"])
def test_a_mixed_batch_samples_each_row_as_it_would_alone(third: str) -> None:
    """Greedy, hot, ranked and penalised rows in one step draw what each draws alone: no
    row's knobs leak into another's (the fast paths are per step, the knobs per row). With
    a row ranked by top_p alone the step sorts its rows; else only the best top_k."""
    top_k = {"top_p alone": 0, "top_k and top_p": 6}[third]
    kinds = [SamplingParams(), SamplingParams(temperature=1.0, seed=3),
             SamplingParams(temperature=0.7, top_p=0.5, top_k=top_k),
             SamplingParams(temperature=1.2, top_k=4, min_p=0.1),
             SamplingParams(repetition_penalty=1.9),
             SamplingParams(temperature=2.0, logprobs=3, presence_penalty=1.0)]  # fmt: skip
    logits = logits_of("flat", len(kinds), 17) + logits_of("random", len(kinds), 17) / 4

    def run(indices: list[int], seed: int) -> list[tuple[int, float, int]]:
        sampler = Sampler(VOCAB)
        pieces = [
            Piece(seq_id=i, token_ids=(i,), start=PROMPT, block_table=(), sample=True,
                  opening=Opening(params=dataclasses.replace(kinds[i], seed=seed),
                                  num_prompt_tokens=PROMPT, history=tuple(range(PROMPT))))
            for i in indices
        ]  # fmt: skip
        sampler.advance(pieces)
        got = sampler.sample(pieces, logits[indices])
        return [(o.token_id, o.logprob, o.rank) for o in got]

    for seed in range(10):
        together = run(list(range(len(kinds))), seed)
        assert together == [run([i], seed)[0] for i in range(len(kinds))], seed


def test_rows_not_asking_are_skipped_and_their_logits_never_read() -> None:
    sampler = Sampler(VOCAB)
    opening = Opening(params=SamplingParams(temperature=1.0, seed=4), num_prompt_tokens=PROMPT)
    pieces = [
        Piece(seq_id=1, token_ids=(1,) * PROMPT, start=0, block_table=(), sample=False,
              opening=opening),
        Piece(seq_id=2, token_ids=(1,) * PROMPT, start=0, block_table=(), sample=True,
              opening=opening),
    ]  # fmt: skip
    sampler.advance(pieces)
    logits = logits_of("random", 2, 5)
    logits[0] = math.nan  # a row not sampled may hold anything
    [out] = sampler.sample(pieces, logits)
    want = sample(logits[1], temperature=1.0, seed=4, position=PROMPT)
    assert (out.seq_id, out.token_id) == (2, want.token_id)


def test_the_uniform_in_tensor_ops_equals_the_one_in_python_ints() -> None:
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    edges = [0, 1, 2**31, 2**32 - 1, 2**53 + 1, 2**63 - 2, 2**63 - 1, 2**63, 2**64 - 1]
    pairs = [(rng.randrange(2**64), rng.randrange(2**64)) for _ in range(5000)]
    pairs += [(s, p) for s in edges for p in edges]
    pairs += [(rng.randrange(10**6), rng.randrange(10**6)) for _ in range(5000)]
    seeds = torch.tensor([as_int64(s) for s, _ in pairs])
    positions = torch.tensor([as_int64(p) for _, p in pairs])
    got = uniforms(seeds, positions).tolist()
    want = [uniform(s, p) for s, p in pairs]
    assert got == want
    assert all(0.0 <= u < 1.0 for u in got)
    assert uniform(2**64 + 7, 3) == uniform(7, 3), "seeds are taken modulo 2**64"
    assert len(set(want)) == len(set(pairs)), "no two pairs drew the same uniform"


def test_a_draw_follows_the_cdf_in_id_order_with_one_uniform() -> None:
    """Probabilities 0.3, 0.1, 0.2, 0.4 in id order: a u below 0.3 draws token 0, below 0.4
    token 1, below 0.6 token 2, else token 3: u's own value decides, no other number."""
    logits = torch.tensor([0.3, 0.1, 0.2, 0.4], dtype=torch.float64).log()
    bounds = [0.3, 0.4, 0.6, 1.0]
    for seed in range(300):
        u = uniform(seed, 5)
        want = next(i for i, b in enumerate(bounds) if u < b - 1e-12 or i == 3)
        if any(abs(u - b) < 1e-9 for b in bounds):
            continue  # within rounding of a boundary: either side is right
        assert sample(logits, temperature=1.0, seed=seed, position=5).token_id == want


def test_the_device_counts_of_a_reopened_sequence_are_the_hosts() -> None:
    """Opened, stepped, closed (its slot reused by another), reopened with its history:
    the counts read back from the device are those counted on the host, every time."""
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    sampler = Sampler(VOCAB)
    params = SamplingParams(frequency_penalty=0.5, repetition_penalty=1.2, max_tokens=99)
    tokens = {s: [rng.randrange(VOCAB) for _ in range(PROMPT)] for s in range(1, 30)}

    def opening(seq_id: int, start: int) -> Opening:
        return Opening(params=params, num_prompt_tokens=PROMPT,
                       history=tuple(tokens[seq_id][:start]))  # fmt: skip

    def check(seq_id: int) -> None:
        counts, seen = sampler.counts_of(seq_id)
        assert counts == dict(Counter(tokens[seq_id][PROMPT:])), seq_id
        assert seen == set(tokens[seq_id]), seq_id

    open_ids: set[int] = set()
    for step in range(60):
        pieces = []
        if step < 20 or rng.random() < 0.3:  # open (or reopen) one; 20 open: past 16 slots
            seq_id = step + 1 if step < 20 else rng.randrange(1, 30)
            start = len(tokens[seq_id]) - 1
            pieces.append(Piece(seq_id=seq_id, token_ids=(tokens[seq_id][-1],), start=start,
                                block_table=(), sample=False,
                                opening=opening(seq_id, start)))  # fmt: skip
            open_ids.add(seq_id)
        for seq_id in sorted(open_ids - {p.seq_id for p in pieces}):
            token = rng.randrange(VOCAB)
            tokens[seq_id].append(token)
            pieces.append(Piece(seq_id=seq_id, token_ids=(token,), start=len(tokens[seq_id]) - 1,
                                block_table=(), sample=False))  # fmt: skip
        sampler.advance(pieces)
        for seq_id in open_ids:
            check(seq_id)
        closing = {s for s in open_ids if step > 20 and rng.random() < 0.2}
        sampler.close(closing)
        open_ids -= closing
    assert sampler.counts.num_slots >= 32, "the table grew past its first 16 slots"


def test_the_grammar_mask_is_unpacked_on_the_device_as_the_one_row_mask() -> None:
    gen = torch.Generator().manual_seed(9)
    vocab = 100  # past the 3 words' 96 bits: those tokens are forbidden
    x = torch.randn(4, vocab, generator=gen, dtype=torch.float64)
    bits = torch.randint(-(2**31), 2**31, (2, 3), generator=gen, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([3, 1])
    got = masked_rows(x, rows, bits)
    assert torch.equal(got[3], masked(x[3], bits[0])) and torch.equal(got[1], masked(x[1], bits[1]))
    assert torch.equal(got[0], x[0]) and torch.equal(got[2], x[2])
    assert bool(torch.isinf(got[3, 96:]).all())


def test_non_finite_logits_fail_the_step_naming_the_first_sequence_that_has_them() -> None:
    for bad in (math.nan, math.inf, -math.inf):
        sampler = Sampler(VOCAB)
        pieces = [
            Piece(seq_id=5 + i, token_ids=(1,), start=PROMPT, block_table=(), sample=True,
                  opening=Opening(params=SamplingParams(temperature=1.0), num_prompt_tokens=PROMPT))
            for i in range(3)
        ]  # fmt: skip
        sampler.advance(pieces)
        logits = logits_of("random", 3, 1)
        logits[1, 7] = bad
        with pytest.raises(NonFiniteLogits, match=r"^the logits of sequence 6 are not finite"):
            sampler.sample(pieces, logits)


def allowing(tokens: list[int], rows: int = 1) -> torch.Tensor:
    """A bitmask [rows, 2] (int32 words) allowing only ``tokens`` (< 64) in every row."""
    words = [0, 0]
    for t in tokens:
        words[t // 32] |= 1 << (t % 32)
    signed = [w - 2**32 if w >= 2**31 else w for w in words]
    return torch.tensor([signed] * rows, dtype=torch.int32)


def constrained_draws(params: SamplingParams, bits: torch.Tensor, mode: str, seeds: range):
    """(token, rank) of one constrained row per seed, through the batched sampler."""
    found = []
    for seed in seeds:
        sampler = Sampler(VOCAB, mode)
        p = dataclasses.replace(params, seed=seed)
        piece = Piece(seq_id=1, token_ids=(3,), start=PROMPT, block_table=(), sample=True,
                      opening=Opening(params=p, num_prompt_tokens=PROMPT,
                                      history=tuple(range(PROMPT))))  # fmt: skip
        sampler.advance([piece])
        done: Future[None] = Future()
        done.set_result(None)
        [out] = sampler.sample([piece], logits_of("random", 1, seed),
                               MaskJob(rows={0: 0}, bits=bits, done=done))  # fmt: skip
        found.append((out.token_id, out.rank))
    return found


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_when_the_knobs_forbid_every_token_the_grammar_allows_the_grammar_wins(mode: str) -> None:
    """min_tokens holds off the only two tokens the grammar allows: the draw is among them
    anyway, and the row reports as a row without knobs (rank 1), as the one-row path did."""
    params = SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=(1, 2),
                            structured=GRAMMAR)  # fmt: skip
    draws = constrained_draws(params, allowing([1, 2]), mode, range(40))
    assert {token for token, _ in draws} == {1, 2}
    assert {rank for _, rank in draws} == {1}


def test_a_constrained_rows_rank_is_under_the_grammars_mask() -> None:
    """A penalised, constrained row that asks for no logprobs still reports its token's
    rank among the tokens the grammar allows (the knobs changed its logits)."""
    params = SamplingParams(temperature=5.0, repetition_penalty=1.5, structured=GRAMMAR)
    draws = constrained_draws(params, allowing([1, 2, 9, 30, 40]), "raw_logprobs", range(60))
    assert {token for token, _ in draws} <= {1, 2, 9, 30, 40}
    assert {rank for _, rank in draws} - {1}, "some draw is not the most probable token"
    assert max(rank for _, rank in draws) <= 5


def test_top_p_keeps_a_token_only_when_the_mass_above_it_is_below_top_p() -> None:
    """Probabilities 1/2, 1/4, 1/4: at top_p 1/2 the mass above the second token is exactly
    1/2, not below it, so only the first is ever drawn."""
    rest = [-1e300] * (VOCAB - 3)  # finite (an infinite logit fails the step), of weight 0
    logits = torch.tensor([[0.0, -math.log(2), -math.log(2), *rest]], dtype=torch.float64)
    assert torch.softmax(logits[0], -1)[:3].tolist() == [0.5, 0.25, 0.25]
    drawn = set()
    for seed in range(100):
        sampler = Sampler(VOCAB)
        p = SamplingParams(temperature=1.0, top_p=0.5, seed=seed)
        piece = Piece(seq_id=1, token_ids=(3,), start=0, block_table=(), sample=True,
                      opening=Opening(params=p, num_prompt_tokens=1))  # fmt: skip
        sampler.advance([piece])
        drawn.add(sampler.sample([piece], logits)[0].token_id)
    assert drawn == {0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU's draws")
def test_on_cuda_a_batch_of_every_knob_draws_what_the_cpu_draws() -> None:
    """64 rows of a 32,000-token vocabulary, each with its own knobs (seeded), over 4 steps:
    the GPU's tokens, ranks and top ids are the CPU's, the logprobs within 1e-12 (a draw
    could differ only where u lands within rounding of a CDF boundary, ~1e-16)."""
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    rng = random.Random(seed)
    vocab, rows = 32_000, 64

    def knob() -> SamplingParams:
        return SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 1, 50]),
            top_p=rng.choice([1.0, 0.9, 0.3]), min_p=rng.choice([0.0, 0.05]),
            repetition_penalty=rng.choice([1.0, 1.3]), frequency_penalty=rng.choice([0.0, 0.5]),
            presence_penalty=rng.choice([0.0, 0.5]), seed=rng.randrange(2**64),
            logprobs=rng.choice([None, 0, 5, 20]), logit_bias=((7, 3.0),), max_tokens=99,
            min_tokens=rng.choice([0, 3]), stop_token_ids=(11,),
        )  # fmt: skip

    params = [knob() for _ in range(rows)]
    histories = [[rng.randrange(vocab) for _ in range(PROMPT + 4)] for _ in range(rows)]
    gen = torch.Generator().manual_seed(seed)
    steps = [torch.randn(rows, vocab, generator=gen) * 3 for _ in range(4)]
    runs = {}
    for device in ("cpu", "cuda"):
        for mode in ("raw_logprobs", "processed_logprobs"):
            sampler = Sampler(vocab, mode, device=device)
            found = []
            for step, logits in enumerate(steps):
                pieces = [
                    Piece(seq_id=i, token_ids=(h[-1],), start=len(h) - 1 + step, block_table=(),
                          sample=True, opening=None if step else Opening(
                              params=params[i], num_prompt_tokens=PROMPT, history=tuple(h[:-1])))
                    for i, h in enumerate(histories)
                ]  # fmt: skip
                sampler.advance(pieces)
                found.append(sampler.sample(pieces, logits.to(device)))
            runs[device, mode] = found
    for mode in ("raw_logprobs", "processed_logprobs"):
        for cpu_step, gpu_step in zip(runs["cpu", mode], runs["cuda", mode], strict=True):
            for c, g in zip(cpu_step, gpu_step, strict=True):
                assert (c.token_id, c.rank) == (g.token_id, g.rank), (mode, c.seq_id)
                assert abs(c.logprob - g.logprob) <= 1e-12
                assert [t for t, _ in c.top] == [t for t, _ in g.top]


def test_the_dense_penalties_of_a_gpu_equal_the_sparse_ones_of_the_cpu() -> None:
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    gen = torch.Generator().manual_seed(seed)
    rows = 8
    sampler = Sampler(VOCAB)
    params = [
        SamplingParams(repetition_penalty=0.5 + i / 5, frequency_penalty=i / 8 - 0.5,
                       presence_penalty=1 - i / 4)
        for i in range(rows)
    ]  # fmt: skip
    pieces = [
        Piece(seq_id=i, token_ids=(1,), start=PROMPT, block_table=(), sample=True,
              opening=Opening(params=p, num_prompt_tokens=PROMPT))
        for i, p in enumerate(params)
    ]  # fmt: skip
    sampler.advance(pieces)
    states = [sampler.seqs[i] for i in range(rows)]
    knobs = build_knobs(
        [s.knobs for s in states],
        [PROMPT + 1] * rows,
        [s.slot for s in states],
        torch.device("cpu"),
    )
    x = torch.randn(rows, VOCAB, generator=gen, dtype=torch.float64) * 4
    counts = torch.randint(0, 3, (rows, VOCAB), generator=gen, dtype=torch.int32)
    seen = (counts > 0) | (torch.rand(rows, VOCAB, generator=gen) < 0.3)
    dense = processed_rows(x, knobs, counts, seen, dense=True)
    sparse = processed_rows(x, knobs, counts, seen, dense=False)
    assert torch.equal(dense, sparse)
    assert not torch.equal(dense, x), "the penalties changed something"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the stream's waits")
def test_on_cuda_a_steps_draw_is_queued_without_waiting_for_the_device() -> None:
    """With two steps in flight the Worker queues a step's draw while the step before runs:
    any copy of pageable memory to the GPU, or read of a device value, would make it wait for
    that step's forward. torch's sync debug mode raises at each such wait."""
    vocab, rows = 32_000, 16
    rng = random.Random(7)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, min_p=0.05, repetition_penalty=1.2, presence_penalty=0.3,
                       frequency_penalty=0.2, logit_bias=((5, 2.0),), min_tokens=9,
                       stop_token_ids=(11,), logprobs=5, seed=4, max_tokens=99),
    ]  # fmt: skip
    sampler = Sampler(vocab, device="cuda")
    histories = [[rng.randrange(vocab) for _ in range(PROMPT)] for _ in range(rows)]

    def pieces_of(step: int) -> list[Piece]:
        return [
            Piece(seq_id=i, token_ids=(h[-1],), start=len(h) - 1 + step, block_table=(),
                  sample=True, opening=None if step else Opening(
                      params=params[i % len(params)], num_prompt_tokens=PROMPT,
                      history=tuple(h[:-1])))
            for i, h in enumerate(histories)
        ]  # fmt: skip

    logits = torch.randn(rows, vocab, device="cuda") * 3
    draw = None
    for step in range(4):
        pieces = pieces_of(step)
        if step < 2:  # the opening, and one step for the allocators and kernels
            sampler.advance(pieces)
            sampler.collect(sampler.queue(pieces, logits, None))
            continue
        # Step 3's inputs are step 2's draw on the device, not read back (penalties count them).
        inputs = None if draw is None else DeviceInputs(tuple(range(rows)), draw.out[:rows].long())
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            sampler.advance(pieces, inputs)
            queued = sampler.queue(pieces, logits, None)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert len(sampler.collect(queued).token_ids) == rows
        draw = queued

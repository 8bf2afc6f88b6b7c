"""The Llama decoder, paged execution against the contiguous forward, sampler and tokenizer."""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from dataclasses import dataclass, field
from functools import cache

import pytest
import torch
from builders import piece

from ringfence.actors.model.decoder import PRESETS, Model, kv_block_bytes
from ringfence.actors.model.draws import uniform
from ringfence.actors.model.paged import PagedExecutor, make_kv_cache
from ringfence.actors.model.reference_sampling import nucleus, sample
from ringfence.actors.text.tokenizer import BOS, EOS, PAD, ByteTokenizer

BLOCK_SIZE = 4
NUM_BLOCKS = 64


@cache
def tiny(dtype: torch.dtype = torch.float64, seed: int = 1) -> Model:
    return Model.from_preset("tiny", dtype, seed)


def make_executor(
    model: Model, *, fill: float = 0.0, num_blocks: int = NUM_BLOCKS
) -> PagedExecutor:
    kv = make_kv_cache(model.config, num_blocks, BLOCK_SIZE, model.dtype).fill_(fill)
    return PagedExecutor(model, kv)


def blocks_for(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def random_split(length: int, rng: random.Random) -> list[int]:
    """Chunk lengths >= 1 that add up to length."""
    cuts = sorted(rng.sample(range(1, length), rng.randint(0, min(3, length - 1))))
    return [b - a for a, b in zip([0, *cuts], [*cuts, length], strict=True)]


@dataclass
class Plan:
    """Prompts, their block tables, and per step the (sequence, piece length) to run."""

    prompts: list[list[int]]
    tables: list[list[int]]
    steps: list[list[tuple[int, int]]]


def make_plan(rng: random.Random, *, num_seqs: int = 4, decode_steps: int = 6) -> Plan:
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 30))] for _ in range(num_seqs)]
    pool = list(range(NUM_BLOCKS))
    rng.shuffle(pool)
    tables = []
    for prompt in prompts:
        need = blocks_for(len(prompt) + decode_steps)
        tables.append(pool[:need])
        del pool[:need]
    queues = [[*random_split(len(p), rng), *[1] * decode_steps] for p in prompts]
    steps = []
    while any(queues):
        ready = [s for s, q in enumerate(queues) if q]
        chosen = sorted(rng.sample(ready, rng.randint(1, len(ready))))
        steps.append([(s, queues[s].pop(0)) for s in chosen])
    return Plan(prompts, tables, steps)


@dataclass
class Run:
    fed: list[list[int]] = field(default_factory=list)  # every token each sequence ran
    generated: list[list[int]] = field(
        default_factory=list
    )  # greedy token after each prefill/decode
    logprobs: list[list[float]] = field(default_factory=list)
    logits: list[list[torch.Tensor]] = field(default_factory=list)  # one row per fed position


def run_plan(plan: Plan, executor: PagedExecutor, *, poison_free: bool = False) -> Run:
    n = len(plan.prompts)
    run = Run(
        [[] for _ in range(n)],
        [[] for _ in range(n)],
        [[] for _ in range(n)],
        [[] for _ in range(n)],
    )
    in_tables = {b for table in plan.tables for b in table}
    free = torch.tensor([b for b in range(NUM_BLOCKS) if b not in in_tables])
    for step in plan.steps:
        pieces = []
        for seq, length in step:
            start = len(run.fed[seq])
            prompt = plan.prompts[seq]
            ids = (
                prompt[start : start + length] if start < len(prompt) else [run.generated[seq][-1]]
            )
            run.fed[seq].extend(ids)
            table = plan.tables[seq][: blocks_for(start + length)]
            pieces.append(piece(ids, start, table))
        if poison_free:
            executor.kv[free] = float("nan")
        out = executor.step(pieces, all_logits=True)
        assert out.all_logits is not None
        rows = torch.split(out.all_logits, [len(p.token_ids) for p in pieces])
        for (seq, _), last, all_rows in zip(step, out.last_logits, rows, strict=True):
            run.logits[seq].extend(all_rows)
            if len(run.fed[seq]) >= len(plan.prompts[seq]):
                token, logprob = sample(last, temperature=0, seed=0, position=len(run.fed[seq]))
                run.generated[seq].append(token)
                run.logprobs[seq].append(logprob)
    return run


def test_paged_mixed_steps_over_shuffled_blocks_equal_the_contiguous_forward(
    rng: random.Random,
) -> None:
    model = tiny()
    plan = make_plan(rng)
    run = run_plan(plan, make_executor(model))
    for seq, prompt in enumerate(plan.prompts):
        assert run.fed[seq][: len(prompt)] == prompt
        reference = model.forward_contiguous(torch.tensor(run.fed[seq]))
        assert torch.allclose(torch.stack(run.logits[seq]), reference, rtol=0, atol=1e-9)
        expected = [
            sample(row, temperature=0, seed=0, position=0) for row in reference[len(prompt) - 1 :]
        ]
        assert run.generated[seq] == [e.token_id for e in expected]
        assert run.generated[seq][:-1] == run.fed[seq][len(prompt) :]
        assert (
            max(abs(a - e.logprob) for a, e in zip(run.logprobs[seq], expected, strict=True)) < 1e-9
        )


def test_a_paged_decode_loop_generates_what_re_forwarding_the_whole_sequence_generates(
    rng: random.Random,
) -> None:
    model = tiny()
    executor = make_executor(model)
    prompt = [rng.randrange(256) for _ in range(10)]
    table = rng.sample(range(NUM_BLOCKS), blocks_for(10 + 16))
    out = executor.step([piece(prompt, 0, table)])
    paged = [sample(out.last_logits[0], temperature=0, seed=0, position=10).token_id]
    for pos in range(10, 10 + 15):
        out = executor.step([piece([paged[-1]], pos, table)])
        paged.append(sample(out.last_logits[0], temperature=0, seed=0, position=pos + 1).token_id)
    contiguous: list[int] = []
    for _ in range(16):
        logits = model.forward_contiguous(torch.tensor(prompt + contiguous))
        contiguous.append(sample(logits[-1], temperature=0, seed=0, position=0).token_id)
    assert paged == contiguous


def test_nan_in_free_blocks_and_unwritten_slots_never_changes_outputs(rng: random.Random) -> None:
    plan = make_plan(rng)
    clean = run_plan(plan, make_executor(tiny()))
    poisoned = run_plan(plan, make_executor(tiny(), fill=float("nan")), poison_free=True)
    assert poisoned.generated == clean.generated
    assert poisoned.logprobs == clean.logprobs
    for seq in range(len(plan.prompts)):
        assert torch.equal(torch.stack(poisoned.logits[seq]), torch.stack(clean.logits[seq]))


def test_nan_in_a_block_of_the_table_does_change_outputs() -> None:
    executor = make_executor(tiny())
    table = [7, 3, 12]
    executor.step([piece(list(range(9)), 0, table)])
    executor.kv[3] = float("nan")
    out = executor.step([piece([42], 9, table)])
    assert bool(torch.isnan(out.last_logits).all())


def test_presets_are_deterministic_per_seed_and_differ_across_seeds() -> None:
    first, again, other = (
        Model.from_preset("tiny", torch.float32, s).state_dict() for s in (5, 5, 6)
    )
    assert list(first) == list(again) == list(other)
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not any(torch.equal(first[k], other[k]) for k in first if not k.endswith("norm.weight"))


def test_parameter_names_follow_hugging_face_llama() -> None:
    names = list(tiny().state_dict())
    layer = [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
        "input_layernorm", "post_attention_layernorm",
    ]  # fmt: skip
    expected = [
        "model.embed_tokens.weight",
        *(f"model.layers.{i}.{p}.weight" for i in range(2) for p in layer),
        "model.norm.weight",
        "lm_head.weight",
    ]
    assert names == expected


def test_the_small_preset_has_the_documented_parameter_count_and_kv_block_bytes() -> None:
    model = Model.from_preset("small")
    assert sum(p.numel() for p in model.parameters()) == 20_980_224
    assert kv_block_bytes(PRESETS["small"], 16, torch.float32) == 262_144
    assert kv_block_bytes(PRESETS["small"], 16, torch.bfloat16) == 131_072
    assert make_kv_cache(PRESETS["small"], 2, 16)[1].nbytes == 262_144


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_and_bfloat16_run_to_finite_outputs(dtype: torch.dtype) -> None:
    model = tiny(dtype)
    executor = make_executor(model)
    prompt = list(b"hello, paged world")
    out = executor.step(
        [
            piece(prompt[:11], 0, [9, 2, 30]),
            piece(prompt, 0, [1, 4, 8, 5, 6]),
        ]
    )
    reference = model.forward_contiguous(torch.tensor(prompt))
    assert out.last_logits.dtype == reference.dtype == dtype
    assert bool(torch.isfinite(out.last_logits).all()) and bool(torch.isfinite(reference).all())
    if dtype == torch.float32:
        assert torch.allclose(out.last_logits[1], reference[-1], rtol=0, atol=1e-4)


def test_the_sampler_is_greedy_at_temperature_zero_and_reproducible_per_seed_and_position() -> None:
    logits = torch.randn(259, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    greedy = sample(logits, temperature=0, seed=1, position=1)
    assert greedy.token_id == int(logits.argmax())
    assert greedy.logprob == float(torch.log_softmax(logits, -1)[greedy.token_id])
    draws = [sample(logits, temperature=1.0, seed=7, position=p) for p in range(20)]
    assert draws == [sample(logits, temperature=1.0, seed=7, position=p) for p in range(20)]
    assert len({d.token_id for d in draws}) > 1
    assert draws != [sample(logits, temperature=1.0, seed=8, position=p) for p in range(20)]
    assert all(d.logprob == float(torch.log_softmax(logits, -1)[d.token_id]) for d in draws)
    with pytest.raises(ValueError, match="temperature"):
        sample(logits, temperature=-1.0, seed=0, position=0)


SEEDS = range(400)


def test_a_tiny_top_p_samples_the_greedy_token_at_any_temperature() -> None:
    logits = torch.randn(259, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    logits[17] = logits[40] = float(logits.max()) + 1.0  # a tie: greedy takes the first
    greedy = sample(logits, temperature=0, seed=0, position=0)
    assert greedy.token_id == 17
    for temperature in (0.1, 1.0, 5.0, 100.0):
        picks = {
            sample(logits, temperature=temperature, seed=s, position=3, top_p=1e-9)
            for s in range(50)
        }
        assert picks == {greedy}, (temperature, picks)


def test_a_draw_never_leaves_the_nucleus_and_visits_every_token_in_it() -> None:
    # Probabilities 0.4, 0.3, 0.2, 0.1 (tokens 3, 0, 2, 1) at temperature 1.
    logits = torch.tensor([0.3, 0.1, 0.2, 0.4], dtype=torch.float64).log()
    cases = {0.35: {3}, 0.4: {3}, 0.45: {3, 0}, 0.75: {3, 0, 2}, 0.95: {3, 0, 2, 1}}
    for top_p, kept in cases.items():
        picks = Counter(
            sample(logits, temperature=1.0, seed=s, position=9, top_p=top_p).token_id for s in SEEDS
        )
        assert set(picks) == kept, (top_p, picks)
    # In proportion within the nucleus: of {3, 0}, token 3 is drawn 4 times in 7.
    picks = Counter(
        sample(logits, temperature=1.0, seed=s, position=9, top_p=0.5).token_id for s in SEEDS
    )
    assert 190 <= picks[3] <= 270, picks


def test_top_p_one_draws_exactly_what_the_sampler_without_it_draws() -> None:
    logits = torch.randn(259, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    for s in range(100):
        plain = sample(logits, temperature=0.8, seed=s, position=s)
        assert sample(logits, temperature=0.8, seed=s, position=s, top_p=1.0) == plain
        # The definition, in plain floats: the first id whose running sum of the softmax
        # exceeds u(seed, position) times the whole.
        probs = torch.softmax(logits / 0.8, dim=-1).tolist()
        running = list(itertools.accumulate(probs))
        threshold = uniform(s, s) * running[-1]
        assert plain.token_id == next(i for i, r in enumerate(running) if r > threshold)


def test_the_nucleus_ranked_among_the_likeliest_tokens_is_the_whole_vocabularys() -> None:
    gen = torch.Generator().manual_seed(11)
    for case in range(60):
        scale = (0.1, 1.0, 4.0, 30.0)[case % 4]  # flat to peaked
        logits = torch.randn(2000, generator=gen, dtype=torch.float64) * scale
        logits[case : case + 40 : 3] = float(logits.max())  # ties at the top
        probs = torch.softmax(logits, dim=-1)
        for top_p in (1e-9, 0.3, 0.9, 0.999, 1 - 1e-15):
            assert torch.equal(nucleus(probs, top_p), _nucleus_by_full_sort(probs, top_p))


def _nucleus_by_full_sort(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    order = sorted(range(len(probs)), key=lambda i: (-float(probs[i]), i))
    running = list(itertools.accumulate(float(probs[i]) for i in order))
    kept = torch.zeros_like(probs)
    for rank, i in enumerate(order):
        if (running[rank - 1] if rank else 0.0) < top_p * running[-1]:
            kept[i] = probs[i]
    return kept


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5, math.nan, math.inf])
def test_a_top_p_outside_zero_to_one_is_refused_naming_it(top_p: float) -> None:
    logits = torch.zeros(8, dtype=torch.float64)
    for temperature in (0.0, 1.0):  # greedy ignores top_p, but not a bad one
        with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got "):
            sample(logits, temperature=temperature, seed=0, position=0, top_p=top_p)


def test_the_tokenizer_round_trips_text_and_skips_specials() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld: 世界 🚀"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.encode(text, bos=True) == [BOS, *ids]
    assert tok.decode([BOS, *ids, EOS, PAD]) == text
    assert tok.decode(list("世".encode())[:2]) == "\ufffd"
    assert tok.vocab_size == PRESETS["tiny"].vocab_size
    with pytest.raises(ValueError, match="negative"):
        tok.decode([-1])


def test_a_block_table_too_short_for_the_positions_is_refused() -> None:
    executor = make_executor(tiny())
    with pytest.raises(
        ValueError, match=r"block table of piece 1 has 1 blocks; positions 0\.\.5 need 2"
    ):
        executor.step(
            [
                piece([1], 0, [0]),
                piece([1, 2], 4, [1]),
            ]
        )


def test_a_position_past_max_position_is_refused() -> None:
    executor = make_executor(tiny(), num_blocks=600)
    with pytest.raises(ValueError, match="piece 0 reaches position 2048, past max_position 2048"):
        executor.step([piece([1], 2048, list(range(513)))])
    with pytest.raises(ValueError, match="past max_position"):
        tiny().forward_contiguous(torch.zeros(2049, dtype=torch.long))


def test_a_block_id_outside_the_kv_tensor_is_refused() -> None:
    executor = make_executor(tiny())
    with pytest.raises(
        ValueError, match="block id 64 of piece 0 is outside the KV tensor's 64 blocks"
    ):
        executor.step([piece([1, 2, 3, 4, 5], 0, [0, 64])])


def test_a_kv_tensor_of_the_wrong_shape_or_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="kv shape"):
        PagedExecutor(tiny(), torch.zeros(4, 3, 2, 4, 2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="kv dtype"):
        PagedExecutor(tiny(), make_kv_cache(tiny().config, 4, 4, torch.float32))


needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CUDA path of paged execution"
)


@needs_cuda
def test_on_cuda_paged_steps_over_nan_free_blocks_equal_the_cpu_run(rng: random.Random) -> None:
    plan = make_plan(rng)
    cpu = run_plan(plan, make_executor(tiny()))
    model = tiny().to("cuda")
    kv = make_kv_cache(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype, "cuda").fill_(
        float("nan")
    )
    cuda = run_plan(plan, PagedExecutor(model, kv), poison_free=True)
    assert cuda.generated == cpu.generated
    assert max(abs(a - b) for s in range(len(plan.prompts)) for a, b in zip(
        cuda.logprobs[s], cpu.logprobs[s], strict=True)) < 1e-9  # fmt: skip

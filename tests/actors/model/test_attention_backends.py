"""Paged steps through each attention backend, and decode steps replayed as CUDA graphs.

The Triton backend (compiled on a CUDA device where there is one, else in Triton's
interpreter on the CPU) must give what the torch backend (the reference) and the contiguous
forward give, on mixed steps of prefill chunks and decodes over shuffled blocks, with NaN
in every slot a step must not read.
"""

from __future__ import annotations

import dataclasses
import random
from functools import cache

import pytest
import torch
from builders import piece

from ringfence.actors.model import attention
from ringfence.actors.model.decoder import PRESETS, Model
from ringfence.actors.model.inputs import DeviceInputs
from ringfence.actors.model.kernels import triton_available
from ringfence.actors.model.paged import PagedExecutor, make_kv_cache

BLOCK_SIZE = 4
NUM_BLOCKS = 48

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="Triton is not installed (the test extra installs it)"
)
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: CUDA graphs and compiled kernels"
)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the Triton backend runs


@cache
def model_of(preset: str, dtype: torch.dtype, window: int | None = None) -> Model:
    """A preset on :data:`DEVICE`, with a sliding window where asked."""
    shape = dataclasses.replace(PRESETS[preset], sliding_window=window)
    return Model(shape, dtype, 1).to(DEVICE)


def cuda_model() -> Model:
    """A fresh tiny float32 model on the GPU (``Module.to`` would move a cached one)."""
    return Model(PRESETS["tiny"], torch.float32, 1).to("cuda")


Step = list[tuple[int, int, int]]  # (sequence, start, length) of each piece


def executor(model: Model, device: str = DEVICE, **options) -> PagedExecutor:
    kv = make_kv_cache(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype, device)
    return PagedExecutor(model, kv.fill_(float("nan")), **options)


def mixed_steps(rng: random.Random, *, num_seqs: int = 4, decodes: int = 3) -> list[Step]:
    """Steps of (sequence, start, length) pieces: each prompt in chunks, then one-token
    decodes; a random subset of the sequences runs in each step."""
    queues = []
    for _ in range(num_seqs):
        prompt = rng.randint(2, 13)
        cut = rng.randint(1, prompt - 1)
        queues.append([(0, cut), (cut, prompt - cut)] + [(prompt + i, 1) for i in range(decodes)])
    steps: list[Step] = []
    while any(queues):
        ready = [s for s, q in enumerate(queues) if q]
        chosen = sorted(rng.sample(ready, rng.randint(1, len(ready))))
        steps.append([(s, *queues[s].pop(0)) for s in chosen])
    return steps


def run(
    ex: PagedExecutor, steps: list[Step], tables: list[list[int]], seed: int
) -> list[torch.Tensor]:
    """Feed every piece seeded random tokens; free blocks and unwritten slots are NaN.
    Returns each step's logits of every token [T, vocab] (float64, on the CPU)."""
    gen = random.Random(seed)
    free = [b for b in range(NUM_BLOCKS) if all(b not in t for t in tables)]
    out = []
    for step in steps:
        ex.kv[free] = float("nan")
        pieces = [
            piece(
                [gen.randrange(256) for _ in range(length)],
                start,
                tables[seq][: -(-(start + length) // BLOCK_SIZE)],
            )
            for seq, start, length in step
        ]
        logits = ex.step(pieces, all_logits=True).all_logits
        assert logits is not None
        out.append(logits.double().cpu())
    return out


def tables_for(rng: random.Random, num_seqs: int) -> list[list[int]]:
    pool = list(range(NUM_BLOCKS))
    rng.shuffle(pool)
    return [pool[i * 6 : (i + 1) * 6] for i in range(num_seqs)]  # 24 positions each


@needs_triton
@pytest.mark.parametrize(("preset", "window"), [("tiny", None), ("tiny-4kv", None), ("tiny", 3)])
def test_triton_attention_gives_the_torch_attentions_logits_over_mixed_steps(
    rng: random.Random, preset: str, window: int | None
) -> None:
    # Three sequences, two decodes each: steps still mix prefill chunks with decodes over
    # shuffled blocks; on the CPU each Triton launch runs in the interpreter, seconds a test.
    model = model_of(preset, torch.float64, window)
    steps = mixed_steps(rng, num_seqs=3, decodes=2)
    tables, seed = tables_for(rng, 3), rng.randrange(1 << 30)
    reference = run(executor(model, attention="torch"), steps, tables, seed)
    triton = run(executor(model, attention="triton"), steps, tables, seed)
    for ours, theirs in zip(triton, reference, strict=True):
        assert bool(torch.isfinite(ours).all())
        assert (ours - theirs).abs().max().item() < 1e-9


def force_splits(monkeypatch, splits: int) -> None:
    """Decode-only steps split as a GPU of few multiprocessors would split them (the CPU never
    does: split_count is 1 there), in shares of one tile: every share boundary is met."""
    from ringfence.actors.model import graphs
    from ringfence.actors.model.kernels import backend

    def count(programs: int, longest: int, device: torch.device, most: int) -> int:
        return min(splits, most)

    for module in (backend, graphs):
        monkeypatch.setattr(module, "split_count", count)
        monkeypatch.setattr(module, "SPLIT_KEYS", 1)


@needs_triton
@pytest.mark.parametrize("window", [None, 5])
def test_decode_kernels_split_among_programs_give_the_torch_attentions_logits(
    rng: random.Random, monkeypatch, window: int | None
) -> None:
    """Decode-only steps with their keys shared out among three programs (a mixed step
    stays whole); ``attention_splits=1`` turns it off, and the shares are then not made."""
    force_splits(monkeypatch, 3)
    model = model_of("tiny-4kv", torch.float64, window)
    # Prompts in chunks beside decodes, then decode-only steps whose contexts grow past the
    # interpreter's 16-key tile: one share, then two hold keys, and the third none.
    steps: list[Step] = [[(0, 0, 7), (1, 0, 4)], [(0, 7, 6), (1, 4, 1), (2, 0, 10)]]
    steps += [[(0, 13 + i, 1), (1, 5 + i, 1), (2, 10 + i, 1)] for i in range(8)]
    tables, seed = tables_for(rng, 3), rng.randrange(1 << 30)
    reference = run(executor(model, attention="torch"), steps, tables, seed)
    split = executor(model, attention="triton")
    for ours, theirs in zip(run(split, steps, tables, seed), reference, strict=True):
        assert bool(torch.isfinite(ours).all())
        assert (ours - theirs).abs().max().item() < 1e-9
    from ringfence.actors.model.kernels.backend import TritonStep

    decode = [piece([1], 9, tables[0][:3])]
    whole = executor(model, attention="triton", attention_splits=1)
    for ex, splits in ((split, 3), (whole, 1)):
        step = ex.backend.prepare(decode)
        assert isinstance(step, TritonStep) and step.tensors.splits == splits


@needs_triton
@pytest.mark.parametrize("preset", ["tiny", "tiny-4kv"])
def test_the_fused_kernels_give_the_triton_steps_logits_over_mixed_steps(
    rng: random.Random, preset: str
) -> None:
    # What a GPU's step runs (Model.use_kernels: stacked projections, q and k rotated in
    # place, their strided views stored and attended), in the interpreter, against the same
    # Triton step on the model's torch ops.
    from ringfence.actors.model.kernels import fused

    model = Model(PRESETS[preset], torch.float32, 1).to(DEVICE)
    steps = mixed_steps(rng, num_seqs=3, decodes=2)
    tables, seed = tables_for(rng, 3), rng.randrange(1 << 30)
    plain = run(executor(model, attention="triton"), steps, tables, seed)
    ex = executor(model, attention="triton")
    model.use_kernels(fused())  # as PagedExecutor does on a GPU
    with_kernels = run(ex, steps, tables, seed)
    for ours, theirs in zip(with_kernels, plain, strict=True):
        assert bool(torch.isfinite(ours).all())
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@needs_triton
def test_triton_attention_decodes_what_the_contiguous_forward_decodes(rng: random.Random) -> None:
    model = model_of("tiny", torch.float32)
    ex = executor(model, attention="triton")
    prompt = [rng.randrange(256) for _ in range(7)]
    table = rng.sample(range(NUM_BLOCKS), 4)
    tokens = [int(ex.step([piece(prompt, 0, table)]).last_logits[0].argmax())]
    for pos in range(7, 7 + 6):
        out = ex.step([piece([tokens[-1]], pos, table[: pos // BLOCK_SIZE + 1])])
        tokens.append(int(out.last_logits[0].argmax()))
    contiguous = model.forward_contiguous(torch.tensor(prompt + tokens[:-1], device=DEVICE))
    assert tokens == contiguous[len(prompt) - 1 :].argmax(-1).tolist()


def test_auto_attention_is_torch_on_a_cpu_and_triton_is_named_when_missing(monkeypatch) -> None:
    kv = torch.empty(1, 1, 2, 1, 1, 2)
    assert attention.resolve_attention("auto", kv) == "torch"
    assert attention.resolve_attention("torch", kv) == "torch"
    monkeypatch.setattr(attention, "triton_available", lambda: False)
    with pytest.raises(
        ValueError, match=r"model\.attention is 'triton' but Triton is not installed"
    ):
        attention.resolve_attention("triton", kv)


@needs_triton
def test_triton_attention_on_a_cpu_outside_the_interpreter_is_refused_naming_it(
    monkeypatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"'triton' with the KV on cpu: .*TRITON_INTERPRET=1"):
        attention.resolve_attention("triton", torch.empty(1))


def test_cuda_graphs_are_ignored_off_cuda() -> None:
    model = Model(PRESETS["tiny"], torch.float32, 1)
    ex = executor(model, "cpu", attention="torch", cuda_graphs=True)
    assert ex.graphs is None


@needs_cuda
@needs_triton
def test_on_cuda_auto_attention_is_triton_except_in_float64() -> None:
    assert attention.resolve_attention("auto", torch.empty(1, device="cuda")) == "triton"
    kv = torch.empty(1, device="cuda", dtype=torch.float64)
    assert attention.resolve_attention("auto", kv) == "torch"


@needs_cuda
@needs_triton
def test_on_cuda_triton_attention_gives_the_torch_attentions_logits(rng: random.Random) -> None:
    model = cuda_model()
    steps, tables, seed = mixed_steps(rng), tables_for(rng, 4), rng.randrange(1 << 30)
    reference = run(executor(model, "cuda", attention="torch"), steps, tables, seed)
    triton = run(executor(model, "cuda", attention="triton"), steps, tables, seed)
    for ours, theirs in zip(triton, reference, strict=True):
        assert (ours - theirs).abs().max().item() < 1e-4


@needs_cuda
@needs_triton
def test_on_cuda_graphs_on_and_off_give_the_same_tokens_over_a_mixed_run(
    rng: random.Random,
) -> None:
    model = cuda_model()
    steps = mixed_steps(rng, num_seqs=5, decodes=6)
    tables, seed = tables_for(rng, 5), rng.randrange(1 << 30)
    runs = {}
    for graphs in (False, True):
        ex = executor(model, "cuda", attention="triton", cuda_graphs=graphs, max_batch=4)
        gen, tokens = random.Random(seed), []
        for step in steps:
            pieces = [
                piece(
                    [gen.randrange(256) for _ in range(n)],
                    s,
                    tables[q][: -(-(s + n) // BLOCK_SIZE)],
                )
                for q, s, n in step
            ]
            tokens.append(ex.step(pieces).last_logits.argmax(-1).tolist())
        runs[graphs] = (tokens, ex)
    assert runs[True][0] == runs[False][0]
    replayed = runs[True][1].graphs
    assert replayed is not None and replayed.captured, "no decode step was replayed"


@needs_cuda
@needs_triton
def test_on_cuda_a_replayed_graph_reads_the_kv_as_it_is_now() -> None:
    model = cuda_model()
    graphs = executor(model, "cuda", attention="triton", cuda_graphs=True, max_batch=8)
    eager = executor(model, "cuda", attention="triton", cuda_graphs=False)
    table = [5, 9, 2]
    prompt = list(range(40, 49))  # 9 tokens: positions 0..8
    for ex in (graphs, eager):
        ex.step([piece(prompt, 0, table)])
    first = graphs.step([piece([7], 9, table)]).last_logits
    assert graphs.graphs is not None and (1, 1) in graphs.graphs.captured
    # Rewrite the prefix in both caches, then decode at the same position again.
    for ex in (graphs, eager):
        ex.step([piece(list(range(60, 69)), 0, table)])
    replayed = graphs.step([piece([7], 9, table)]).last_logits
    expected = eager.step([piece([7], 9, table)]).last_logits
    assert not torch.allclose(replayed, first), "the replay read the old KV"
    assert torch.allclose(replayed, expected, atol=1e-5, rtol=0)


def prefilled(
    rng: random.Random, num_seqs: int
) -> tuple[Model, PagedExecutor, list[list[int]], list[list[int]]]:
    """A float64 model's Triton executor with ``num_seqs`` random prompts prefilled: the
    model, the executor, each sequence's table and prompt."""
    model = model_of("tiny", torch.float64)
    eager = executor(model, attention="triton")
    tables = tables_for(rng, num_seqs)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 12))] for _ in tables]
    eager.step(
        [piece(p, 0, t[: -(-len(p) // BLOCK_SIZE)]) for p, t in zip(prompts, tables, strict=True)]
    )
    return model, eager, tables, prompts


@needs_triton
@pytest.mark.parametrize("splits", [1, 3])
def test_a_graphs_padded_bucket_computes_the_eager_steps_logits_and_writes_only_its_slots(
    rng: random.Random, monkeypatch, splits: int
) -> None:
    """What a replay computes, run eagerly (on any device): three decodes padded to bucket 4,
    their keys whole or shared out among three programs (the padding row's shares empty)."""
    from ringfence.actors.model.graphs import DecodeGraphs

    force_splits(monkeypatch, splits)

    model, eager, tables, prompts = prefilled(rng, 3)
    decodes = [
        piece([rng.randrange(256)], len(p), t[: len(p) // BLOCK_SIZE + 1])
        for p, t in zip(prompts, tables, strict=True)
    ]
    before = eager.kv.clone()
    expected = eager.step(decodes).last_logits
    after = eager.kv.clone()
    eager.kv.copy_(before)
    graphs = DecodeGraphs(model, eager.kv, max_batch=6)
    assert graphs.buckets == (1, 2, 4, 6)
    logits = graphs.run_eager(decodes)
    assert (logits - expected).abs().max().item() < 1e-9
    # The same slots written (NaN left where it was), with the same values up to the last
    # bits (a matmul over 4 rows need not round as one over 3 does).
    assert torch.equal(eager.kv.isnan(), after.isnan()), "padding wrote KV"
    assert torch.allclose(eager.kv, after, rtol=0, atol=1e-12, equal_nan=True)
    assert int(graphs.slots[3]) == -1 and int(graphs.seq_lens[3]) == 0


@needs_triton
def test_a_graph_splits_only_a_context_longer_than_a_share_within_its_window(monkeypatch) -> None:
    from ringfence.actors.model import graphs as graphs_module
    from ringfence.actors.model.graphs import DecodeGraphs

    force_splits(monkeypatch, 3)
    monkeypatch.setattr(graphs_module, "SPLIT_KEYS", 4)
    for window, expected in ((None, 3), (3, 1), (5, 3)):
        model = model_of("tiny", torch.float64, window)
        graphs = DecodeGraphs(model, executor(model, attention="triton").kv, max_batch=4)
        long, short = piece([1], 9, [0, 1, 2]), piece([1], 3, [4])
        assert graphs.variant([long, short]) == (2, expected), window
        assert graphs.variant([short]) == (1, 1), "4 keys: one share"


@needs_triton
@pytest.mark.parametrize("splits", [1, 3])
def test_the_padding_rows_a_capture_at_start_runs_write_and_read_no_kv(
    monkeypatch, splits: int
) -> None:
    """What :meth:`DecodeGraphs.capture_all` runs, eagerly (on any device): a bucket of
    padding rows leaves every bit of the KV as it was, NaN included, and reads none of it."""
    from ringfence.actors.model.graphs import DecodeGraphs

    force_splits(monkeypatch, splits)

    model = model_of("tiny", torch.float64)
    kv = executor(model, attention="triton").kv
    kv.normal_()
    kv[::3] = float("nan")  # poisoned blocks: a read of one shows in the logits
    before = kv.clone()
    graphs = DecodeGraphs(model, kv, max_batch=6)
    variants = graphs.variants()
    assert [v.bucket for v in variants if v.splits == splits] == [6, 4, 2, 1]
    assert len(variants) == (4 if splits == 1 else 8), "a split graph beside each whole one"
    for variant in variants:
        logits = graphs.run_padding(variant)
        assert logits.shape[0] == variant.bucket and bool(logits.isfinite().all()), variant
    assert torch.equal(kv.isnan(), before.isnan()) and torch.equal(
        kv.nan_to_num(), before.nan_to_num()
    ), "a padding row wrote KV"


@needs_cuda
@needs_triton
def test_on_cuda_every_bucket_is_captured_at_start_and_touches_no_kv() -> None:
    model = cuda_model()
    ex = executor(model, "cuda", attention="triton", cuda_graphs=True, max_batch=6)
    assert ex.graphs is not None
    ex.kv.normal_()
    ex.kv[::2] = float("nan")
    before = ex.kv.clone()
    captured = ex.graphs.capture_all()
    assert captured == ex.graphs.variants() and [v.bucket for v in captured] == [6, 4, 2, 1]
    assert set(ex.graphs.captured) == set(captured) and ex.graphs.capture_all() == []
    torch.cuda.synchronize()
    assert torch.equal(ex.kv.isnan(), before.isnan())
    assert torch.equal(ex.kv.nan_to_num(), before.nan_to_num()), "a capture wrote KV"


@needs_cuda
@needs_triton
def test_on_cuda_a_split_graph_gives_the_whole_eager_steps_logits(monkeypatch) -> None:
    """A bucket's split graph, captured at start and replayed for a context longer than a
    share, against an eager step that reads it whole."""
    force_splits(monkeypatch, 3)
    model = cuda_model()
    graphs = executor(model, "cuda", attention="triton", cuda_graphs=True, max_batch=4)
    eager = executor(model, "cuda", attention="triton", attention_splits=1)
    assert graphs.graphs is not None
    assert (1, 3) in graphs.graphs.capture_all()
    tables = [[5, 9, 2, 17], [3, 11, 8, 30]]
    prompts = [list(range(40, 53)), list(range(60, 67))]  # 13 and 7 tokens
    pairs = list(zip(prompts, tables, strict=True))
    for ex in (graphs, eager):
        ex.step([piece(p, 0, t[: -(-len(p) // BLOCK_SIZE)]) for p, t in pairs])
    decodes = [piece([7], len(p), t[: len(p) // BLOCK_SIZE + 1]) for p, t in pairs]
    assert graphs.graphs.variant(decodes) == (2, 3)
    replayed = graphs.step(decodes).last_logits
    assert (2, 3) in graphs.graphs.captured
    expected = eager.step(decodes).last_logits
    assert torch.allclose(replayed, expected, atol=1e-5, rtol=0)


@needs_cuda
@needs_triton
def test_on_cuda_a_step_is_queued_without_waiting_for_the_device() -> None:
    # With two steps in flight the Worker queues a step while the step before runs: a copy of
    # pageable memory to the GPU, or a read of a device value (an id check), would make it
    # wait for that step's forward. torch's sync debug mode raises at each such wait.
    model = cuda_model()
    ex = executor(model, "cuda", attention="triton", cuda_graphs=True, max_batch=4)
    assert ex.graphs is not None
    ex.graphs.capture_all()
    tables = [[3, 9, 1, 20], [7, 2, 30, 11]]

    def at(seq: int, tokens: list[int], start: int):
        return piece(tokens, start, tables[seq][: -(-(start + len(tokens)) // BLOCK_SIZE)])

    ex.step([at(0, [5, 6, 7, 8, 9], 0), at(1, [1, 2, 3], 0)])  # eager: kernels compiled
    ex.step([at(0, [3], 5), at(1, [4], 3)])  # a replay
    torch.cuda.synchronize()
    # And with inputs on the device (a step launched before the last one's tokens were read).
    drawn = torch.tensor([3, 4], device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        replayed = ex.step([at(0, [3], 6), at(1, [4], 4)])
        eager = ex.step([at(0, [3, 4], 7), at(1, [5], 5)])  # a chunk and a decode
        on_device = ex.step([at(0, [0], 9), at(1, [0], 6)], inputs=DeviceInputs((0, 1), drawn))
        mixed = ex.step([at(0, [0], 10), at(1, [5, 6], 7)], inputs=DeviceInputs((0,), drawn[:1]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for out in (replayed, eager, on_device, mixed):
        assert bool(torch.isfinite(out.last_logits).all())


def test_a_steps_inputs_on_the_device_give_the_logits_of_the_step_with_them_put_in(
    rng: random.Random,
) -> None:
    """A step launched before the step before's tokens were read back takes some pieces'
    one token from the device (``DeviceInputs``; their own ids are placeholders): the torch
    backend over a mixed step (prefill chunks among the decodes, so the rows are the
    pieces' last) computes what the same step with the tokens in the pieces does."""
    model = model_of("tiny", torch.float64)
    tables = tables_for(rng, 4)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 12))] for _ in tables]
    prefills = [
        piece(p, 0, t[: -(-len(p) // BLOCK_SIZE)])
        for p, t in zip(prompts[:3], tables[:3], strict=True)
    ]
    steps = [executor(model), executor(model)]
    for ex in steps:
        ex.step(prefills)
    tokens = [rng.randrange(1, 256) for _ in range(3)]
    chunk = prompts[3]
    mixed = [
        piece([tokens[0]], len(prompts[0]), tables[0][: len(prompts[0]) // BLOCK_SIZE + 1]),
        piece(chunk, 0, tables[3][: -(-len(chunk) // BLOCK_SIZE)]),
        piece([tokens[1]], len(prompts[1]), tables[1][: len(prompts[1]) // BLOCK_SIZE + 1]),
        piece([tokens[2]], len(prompts[2]), tables[2][: len(prompts[2]) // BLOCK_SIZE + 1]),
    ]
    expected = steps[0].step(mixed, all_logits=True).all_logits
    blank = [dataclasses.replace(p, token_ids=(0,)) if i != 1 else p for i, p in enumerate(mixed)]
    inputs = DeviceInputs((0, 2, 3), torch.tensor(tokens))
    got = steps[1].step(blank, all_logits=True, inputs=inputs).all_logits
    assert expected is not None and got is not None
    assert torch.equal(got, expected)
    assert torch.equal(steps[1].kv.isnan(), steps[0].kv.isnan())


@needs_triton
def test_a_graphs_inputs_on_the_device_give_the_logits_of_the_step_with_them_put_in(
    rng: random.Random,
) -> None:
    """The same for a decode step replayed as a graph, run eagerly: its rows are its pieces."""
    from ringfence.actors.model.graphs import DecodeGraphs

    model, eager, tables, prompts = prefilled(rng, 3)
    tokens = [rng.randrange(1, 256) for _ in tables]
    decodes = [
        piece([token], len(p), t[: len(p) // BLOCK_SIZE + 1])
        for token, p, t in zip(tokens, prompts, tables, strict=True)
    ]
    before = eager.kv.clone()
    graphs = DecodeGraphs(model, eager.kv, max_batch=4)
    expected = graphs.run_eager(decodes)
    eager.kv.copy_(before)
    blank = [dataclasses.replace(p, token_ids=(0,)) for p in decodes]
    got = graphs.run_eager(blank, DeviceInputs((0, 2), torch.tensor([tokens[0], tokens[2]])))
    wrong = graphs.run_eager(blank)  # its second row reads the placeholder: it differs
    assert torch.equal(got[[0, 2]], expected[[0, 2]])
    assert not torch.equal(wrong[1], expected[1]) and torch.equal(got[1], wrong[1])

"""The Triton kernels against attention written out by hand: compiled on a CUDA device where
there is one, else in Triton's interpreter on the CPU.

The reference gathers each piece's keys position by position from its block table and takes
a float64 softmax over the keys each query may see, on the CPU; it shares no code with the
kernels or with the torch backend. Shapes are tiny: the interpreter runs a kernel's every
program in Python.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from builders import piece
from hopper import compiled_for_hopper

from ringfence.actors.model.kernels import triton_available
from ringfence.sched.ops import Piece

pytestmark = pytest.mark.skipif(
    not triton_available(), reason="Triton is not installed (the test extra installs it)"
)
if triton_available():
    from ringfence.actors.model.kernels import split_keys
    from ringfence.actors.model.kernels.backend import step_tensors
    from ringfence.actors.model.kernels.kv_store import store_kv
    from ringfence.actors.model.kernels.paged_attention import (
        TILE_N,
        StepTensors,
        paged_attention,
    )

BLOCK_SIZE = 4
NUM_BLOCKS = 80
# bfloat16: on a GPU the softmax weights are rounded to bfloat16 before they meet V.
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 3e-2}
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class Case:
    pieces: list[Piece]  # the step's pieces (token ids are placeholders: only their count matters)
    k_cache: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim], NaN where unwritten
    v_cache: torch.Tensor
    q: torch.Tensor  # [T, heads, head_dim]


def make_case(
    rng: random.Random,
    spans: list[tuple[int, int]],
    *,
    kv_heads: int = 2,
    group: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
) -> Case:
    """Pieces of (start, length) over shuffled, disjoint block tables; every slot a piece
    may read (positions 0..start+length-1 of its table) holds a value, every other slot NaN."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    shape = (NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    pieces = []
    for start, length in spans:
        end = start + length
        table = [free.pop() for _ in range(-(-end // BLOCK_SIZE))]
        for pos in range(end):
            slot = (table[pos // BLOCK_SIZE], pos % BLOCK_SIZE)
            k_cache[slot] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
            v_cache[slot] = torch.randn(kv_heads, head_dim, generator=gen).to(dtype)
        pieces.append(piece([0] * length, start, table))
    total = sum(length for _, length in spans)
    q = torch.randn(total, kv_heads * group, head_dim, generator=gen).to(dtype)
    return Case(pieces, k_cache.to(DEVICE), v_cache.to(DEVICE), q.to(DEVICE))


def reference(case: Case, window: int | None) -> torch.Tensor:
    """Each query token's attention over the keys it sees, in float64, by hand."""
    kv_heads = case.k_cache.shape[2]
    group = case.q.shape[1] // kv_heads
    out = torch.zeros(case.q.shape, dtype=torch.float64)
    k_cache, v_cache, queries = case.k_cache.cpu(), case.v_cache.cpu(), case.q.cpu()
    row = 0
    for p in case.pieces:
        for t in range(len(p.token_ids)):
            pos = p.start + t
            seen = [j for j in range(pos + 1) if window is None or j > pos - window]
            slots = [(p.block_table[j // BLOCK_SIZE], j % BLOCK_SIZE) for j in seen]
            keys = torch.stack([k_cache[s] for s in slots]).double()  # [keys, kv, dim]
            values = torch.stack([v_cache[s] for s in slots]).double()
            for head in range(queries.shape[1]):
                q = queries[row, head].double()
                scores = keys[:, head // group] @ q / q.shape[0] ** 0.5
                out[row, head] = torch.softmax(scores, 0) @ values[:, head // group]
            row += 1
    return out


def run_kernel(
    case: Case, window: int | None, splits: int = 1, split_keys: int = 0
) -> torch.Tensor:
    group = case.q.shape[1] // case.k_cache.shape[2]
    step = step_tensors(case.pieces, BLOCK_SIZE, group, DEVICE)
    step = step._replace(splits=splits, split_keys=split_keys)
    out = torch.full_like(case.q, float("nan"))
    paged_attention(case.q, case.k_cache, case.v_cache, out, step, window=window)
    return out


def assert_close(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert bool(torch.isfinite(out).all()), "a slot the step must not read was read"
    error = (out.cpu().double() - expected).abs().max().item()
    assert error < TOLERANCE[dtype], f"max abs error {error:.3g} in {dtype}"


# Lengths at and around block boundaries (BLOCK_SIZE 4), decodes and prefill chunks, chunks
# from position 0 and past it (a cached prefix), all in one step.
MIXED = [(0, 1), (3, 1), (4, 1), (7, 1), (0, 4), (0, 9), (5, 3), (8, 8), (11, 6), (30, 1)]


@pytest.mark.parametrize("group", [1, 2, 4])
def test_a_mixed_step_attends_as_the_reference_for_each_gqa_group(rng, group: int) -> None:
    case = make_case(rng, MIXED, group=group)
    assert_close(run_kernel(case, None), reference(case, None), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_float64_and_bfloat16_kv_attend_as_the_reference(rng, dtype: torch.dtype) -> None:
    case = make_case(rng, MIXED, dtype=dtype)
    assert_close(run_kernel(case, None), reference(case, None), dtype)


@pytest.mark.parametrize("window", [1, 3, 5])
def test_a_sliding_window_hides_the_keys_older_than_it(rng, window: int) -> None:
    case = make_case(rng, MIXED, group=2)
    expected = reference(case, window)
    assert_close(run_kernel(case, window), expected, torch.float32)
    assert not torch.allclose(expected, reference(case, None)), "the window must matter here"


def test_a_head_dim_that_is_no_power_of_two_is_masked_to_its_width(rng) -> None:
    case = make_case(rng, [(0, 5), (6, 1), (2, 3)], head_dim=12, kv_heads=1, group=4)
    assert_close(run_kernel(case, None), reference(case, None), torch.float32)


def test_random_ragged_steps_attend_as_the_reference(rng) -> None:
    for _ in range(3):
        spans = []
        for _ in range(rng.randint(1, 5)):
            start = rng.randrange(0, 20)
            spans.append((start, 1 if rng.random() < 0.5 else rng.randint(2, 10)))
        case = make_case(rng, spans, group=rng.choice([1, 2, 4]))
        window = rng.choice([None, rng.randint(1, 12)])
        assert_close(run_kernel(case, window), reference(case, window), torch.float32)


def test_a_piece_with_no_context_reads_nothing_and_attends_to_zero(rng) -> None:
    """What a captured graph's padding row does: context length 0 visits no key."""
    case = make_case(rng, [(5, 1), (0, 1)])
    real = step_tensors(case.pieces, BLOCK_SIZE, 2, DEVICE)
    padded = StepTensors(
        slots=real.slots,
        tables=real.tables,
        query_start=real.query_start,
        seq_lens=torch.tensor([6, 0], dtype=torch.int32, device=DEVICE),
        program_piece=real.program_piece,
        program_first=real.program_first,
        block_q=real.block_q,
    )
    out = torch.full_like(case.q, float("nan"))
    paged_attention(case.q, case.k_cache, case.v_cache, out, padded, window=None)
    assert_close(out[:1], reference(case, None)[:1], torch.float32)
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))


# Decodes whose contexts span many tiles of the interpreter's 16 keys, and one that ends at
# a tile's edge, one inside the first tile, one at the first key: shares full, partial, empty.
LONG_DECODES = [(70, 1), (47, 1), (5, 1), (0, 1), (31, 1), (100, 1)]


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_keys_shared_out_among_programs_attend_as_the_reference(rng, splits: int) -> None:
    """Each share's output and log-sum, merged, is the unsplit attention: for shares of one
    tile (split_keys 1 rounds up to a tile) and of two, decodes and a mixed step."""
    for spans, group in ((LONG_DECODES, 4), (MIXED, 2)):
        case = make_case(rng, spans, group=group)
        expected = reference(case, None)
        for split_keys in (1, 2 * TILE_N):
            out = run_kernel(case, None, splits=splits, split_keys=split_keys)
            assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_split_keys_keep_the_dtype_exactness(rng, dtype: torch.dtype) -> None:
    case = make_case(rng, LONG_DECODES, dtype=dtype)
    assert_close(run_kernel(case, None, splits=4, split_keys=1), reference(case, None), dtype)


@pytest.mark.parametrize("window", [3, 20, 40])
def test_split_keys_share_out_only_the_window(rng, window: int) -> None:
    """The shares run from the window's first key: a window that starts inside a tile, and
    one that leaves whole shares with nothing to see."""
    case = make_case(rng, LONG_DECODES, group=2)
    expected = reference(case, window)
    assert_close(run_kernel(case, window, splits=5, split_keys=1), expected, torch.float32)


def test_a_split_step_with_no_context_leaves_zero(rng) -> None:
    """A captured graph's padding row under splits: every share is empty, the merge 0."""
    case = make_case(rng, [(40, 1), (0, 1)])
    real = step_tensors(case.pieces, BLOCK_SIZE, 2, DEVICE)
    lens = torch.tensor([41, 0], dtype=torch.int32, device=DEVICE)
    padded = real._replace(seq_lens=lens, splits=3, split_keys=1)
    out = torch.full_like(case.q, float("nan"))
    paged_attention(case.q, case.k_cache, case.v_cache, out, padded, window=None)
    assert_close(out[:1], reference(case, None)[:1], torch.float32)
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))


def test_the_shares_are_the_merge_s_only_input(rng) -> None:
    """A mutant merge that drops the last share's weight gives another output: the test
    above would see a merge that ignored a share (the shares really differ)."""
    case = make_case(rng, [(70, 1)], group=4)
    step = step_tensors(case.pieces, BLOCK_SIZE, 4, DEVICE)._replace(splits=3, split_keys=1)
    partials = split_keys.Partials.empty(case.q, 3, torch.float32)
    out = torch.empty_like(case.q)
    paged_attention(case.q, case.k_cache, case.v_cache, out, step, window=None, partials=partials)
    assert bool(torch.isfinite(partials.lse).all()), "three shares of 71 keys: none empty"
    partials.lse[:, :, 2] = float("-inf")
    dropped = torch.empty_like(case.q)
    split_keys.merge_splits(partials, dropped)
    assert not torch.allclose(dropped, out, atol=1e-3)


def test_split_count_fills_the_multiprocessors_and_no_more(monkeypatch) -> None:
    monkeypatch.setattr(split_keys, "_multiprocessors", lambda index: 132)
    count = split_keys.split_count
    cuda = torch.device("cuda", 0)
    assert count(8, 32768, torch.device("cpu")) == 1, "the interpreter runs programs in turn"
    assert count(8, 32768, cuda) == split_keys.MOST_SPLITS, "1 sequence x 8 KV heads"
    assert count(8, 512, cuda) == 2, "no share under SPLIT_KEYS keys"
    assert count(64, 32768, cuda) == 5, "8 sequences: 264 programs wanted"
    assert count(512, 32768, cuda) == 1, "64 sequences fill the device alone"
    assert count(8, 32768, cuda, most=1) == 1, "splitting turned off"


def test_the_store_writes_exactly_the_named_slots_and_skips_negative_ones(rng) -> None:
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    kv_heads, head_dim = 2, 12
    k_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, kv_heads, head_dim, generator=gen)
    chosen = rng.sample(range(NUM_BLOCKS * BLOCK_SIZE), 6)
    slots = torch.tensor([chosen[0], -1, *chosen[1:3], -1, *chosen[3:]], dtype=torch.int32)
    k = torch.randn(len(slots), kv_heads, head_dim, generator=gen)
    v = torch.randn(len(slots), kv_heads, head_dim, generator=gen)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k.view(-1, kv_heads, head_dim)[slot] = k[row]
            expected_v.view(-1, kv_heads, head_dim)[slot] = v[row]
    k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
    store_kv(k.to(DEVICE), v.to(DEVICE), k_dev, v_dev, slots.to(DEVICE))
    assert torch.equal(k_dev.cpu(), expected_k)
    assert torch.equal(v_dev.cpu(), expected_v)


def test_the_store_writes_through_a_layer_view_of_the_block_major_tensor(rng) -> None:
    """The KV tensor's layer views are strided (every layer's K and V share a block)."""
    gen = torch.Generator().manual_seed(rng.randrange(1 << 31))
    kv = torch.zeros(NUM_BLOCKS, 3, 2, BLOCK_SIZE, 2, 8, device=DEVICE)
    k = torch.randn(2, 2, 8, generator=gen).to(DEVICE)
    v = torch.randn(2, 2, 8, generator=gen).to(DEVICE)
    slots = torch.tensor([9, 2 * BLOCK_SIZE + 3], dtype=torch.int32, device=DEVICE)
    store_kv(k, v, kv[:, 1, 0], kv[:, 1, 1], slots)
    assert torch.equal(kv[2, 1, 0, 1], k[0]) and torch.equal(kv[2, 1, 1, 1], v[0])
    assert torch.equal(kv[2, 1, 0, 3], k[1]) and torch.equal(kv[2, 1, 1, 3], v[1])
    assert int((kv != 0).sum()) == 4 * 2 * 8, "nothing but the two slots of layer 1"


# Compiles each kernel as a GPU would see it (Triton's compiler for sm_90, an H100/H200:
# PTX and a cubin), in a process where the interpreter is off; no GPU is needed for that.
COMPILE_FOR_SM90 = r"""
import math, os, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ringfence.actors.model.kernels import kv_store
from ringfence.actors.model.kernels import paged_attention as pa
from ringfence.actors.model.kernels import split_keys as sk

POINTER = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float64: "*fp64"}

def build(kernel, dtype, constants, tensors, indices, accs=()):
    names = list(kernel.arg_names)
    acc = POINTER[torch.float64 if dtype == torch.float64 else torch.float32]
    signature = {
        n: "constexpr" if n in constants else POINTER[dtype] if n in tensors
        else acc if n in accs else "*i32" if n in indices else "i32"
        for n in names
    }
    constexprs = {(names.index(n),): v for n, v in constants.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32))

CASES = (
    (torch.bfloat16, 4, 1), (torch.bfloat16, 16, 1), (torch.float32, 4, 1), (torch.float64, 4, 1),
    (torch.bfloat16, 4, 16), (torch.float64, 4, 16),
)  # fmt: skip
for dtype, block_q, splits in CASES:  # block_q 4: a decode's tile, 16: a prefill chunk's
    constants = dict(
        BLOCK_SIZE=16, HEAD_DIM=64, HEAD_P=64, GROUP=4, BLOCK_Q=block_q, BLOCK_M=4 * block_q,
        TILE=32, SCALE=64**-0.5 * math.log2(math.e), UPCAST=False, PRODUCTS=pa._products(dtype),
        ACC=tl.float64 if dtype == torch.float64 else tl.float32, SPLIT=splits > 1,
    )
    tensors = ("q_ptr", "k_ptr", "v_ptr", "out_ptr")
    indices = ("tables_ptr", "query_start_ptr", "seq_lens_ptr", "program_piece_ptr")
    indices += ("program_first_ptr",)
    accs = ("part_ptr", "lse_ptr")
    compiled = build(pa._paged_attention, dtype, constants, tensors, indices, accs)
    print("attention", str(dtype), block_q, splits, len(compiled.asm["cubin"]) > 0)
    if splits > 1:
        constants = dict(SPLITS_P=splits, HEAD_DIM=64, HEAD_P=64)
        compiled = build(sk._merge_splits, dtype, constants, ("out_ptr",), (), accs)
        print("merge", str(dtype), block_q, splits, len(compiled.asm["cubin"]) > 0)
    constants = dict(BLOCK_SIZE=16, KV_HEADS=8, HEAD_DIM=64, HEADS_P=8, HEAD_P=64)
    tensors = ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")
    compiled = build(kv_store._store_kv, dtype, constants, tensors, ("slots_ptr",))
    print("store", str(dtype), block_q, len(compiled.asm["cubin"]) > 0)
"""


def test_the_kernels_compile_for_a_hopper_gpu_even_without_one() -> None:
    lines = compiled_for_hopper(COMPILE_FOR_SM90)
    assert len(lines) == 14 and all(line.endswith("True") for line in lines), lines

"""The batched block copy (``actors/kv/block_kernel.py``) against the per-run copies, bit for
bit: on a CUDA device between a device tensor and a registered, mapped host tensor (the swap
lane's case), else in Triton's interpreter between two CPU tensors.

Every block is filled with random bits (NaN payloads included, in every dtype), so a block
copied from the wrong place, a chunk left out or a word rounded through a float shows.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from hopper import compiled_for_hopper

from ringfence.actors.config import Config
from ringfence.actors.kv import copies
from ringfence.actors.kv.copies import HOST_MAPPED, copy_blocks, resolve_copy
from ringfence.actors.model.kernels import triton_available
from ringfence.actors.preflight import check_copy_kernel

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="Triton is not installed (the test extra installs it)"
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
if triton_available():
    from ringfence.actors.kv.block_kernel import copy_scattered, device_rows, word_of

DEVICE = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
# [blocks, layers, 2, block_size, kv_heads, head_dim]: a small block-major KV tensor.
SHAPE = (24, 2, 2, 4, 2, 8)
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bits viewed as ``dtype``: NaNs with every payload, infinities, subnormals."""
    gen = torch.Generator().manual_seed(seed)
    bits = BITS[dtype]
    info = torch.iinfo(bits)
    words = torch.randint(info.min, info.max, shape, dtype=bits, generator=gen)
    return words.view(dtype)


def bits_of(kv: torch.Tensor) -> torch.Tensor:
    return kv.cpu().view(BITS[kv.dtype]).clone()


@pytest.fixture
def host_tier() -> Iterator[list[torch.Tensor]]:
    """Host tensors made by :func:`host`; on CUDA registered and mapped as the swap lane
    registers its host tier, unregistered after the test."""
    made: list[torch.Tensor] = []
    yield made
    for t in made:
        if torch.cuda.is_available():
            torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def host(made: list[torch.Tensor], t: torch.Tensor) -> torch.Tensor:
    if torch.cuda.is_available():
        nbytes = t.numel() * t.element_size()
        with torch.cuda.device(DEVICE):
            code = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, HOST_MAPPED)
        assert int(code) == 0, f"cudaHostRegister: {code}"
        made.append(t)
    return t


def both_ways(
    made: list[torch.Tensor],
    direction: str,
    dtype: torch.dtype,
    seed: int,
    shape: tuple[int, ...] = SHAPE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(src, dst) of random bits: host -> device for "in", device -> host for "out"."""
    h = host(made, random_bits(shape, dtype, seed))
    d = random_bits(shape, dtype, seed + 1).to(DEVICE)
    return (h, d) if direction == "in" else (d, h)


def check_against_runs(
    src: torch.Tensor,
    src_ids: list[int],
    dst: torch.Tensor,
    dst_ids: list[int],
    *,
    chunk: int = 0,
) -> None:
    """The kernel leaves in ``dst`` exactly what the per-run copies leave in a copy of it."""
    expected = dst.clone()
    copy_blocks(src, src_ids, expected, dst_ids)
    before = bits_of(dst)
    copy_scattered(src, src_ids, dst, dst_ids, chunk=chunk)
    if dst.is_cuda or src.is_cuda:
        torch.cuda.synchronize(DEVICE)
    assert torch.equal(bits_of(dst), bits_of(expected))
    untouched = [b for b in range(dst.shape[0]) if b not in dst_ids]
    assert torch.equal(bits_of(dst)[untouched], before[untouched]), "an unnamed block changed"


# Equal bytes.


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("direction", ["in", "out"])
def test_random_scattered_blocks_copy_as_the_per_run_copies_in_every_kv_dtype(
    rng: random.Random, host_tier: list[torch.Tensor], direction: str, dtype: torch.dtype
) -> None:
    for _ in range(3):
        src, dst = both_ways(host_tier, direction, dtype, rng.randrange(1 << 30))
        n = rng.randint(1, SHAPE[0])
        src_ids = [rng.randrange(SHAPE[0]) for _ in range(n)]  # a source may repeat
        dst_ids = rng.sample(range(SHAPE[0]), n)
        check_against_runs(src, src_ids, dst, dst_ids)


@needs_triton
@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [
        ([2, 3, 4, 3, 4, 5], [10, 11, 12, 0, 1, 2]),  # overlapping source runs
        ([5, 6, 7], [8, 9, 10]),  # one run, adjacent on both sides
        ([7, 6, 5, 4], [1, 2, 3, 4]),  # adjacent ids, one side descending
        ([9], [9]),  # a single block, same id on both sides
        ([0, 23], [23, 0]),  # the first and last blocks, crossed
    ],
    ids=["overlapping", "adjacent", "descending", "single", "ends"],
)
@pytest.mark.parametrize("direction", ["in", "out"])
def test_overlapping_adjacent_and_single_block_ids_copy_as_the_per_run_copies(
    rng: random.Random,
    host_tier: list[torch.Tensor],
    direction: str,
    src_ids: list[int],
    dst_ids: list[int],
) -> None:
    src, dst = both_ways(host_tier, direction, torch.float32, rng.randrange(1 << 30))
    check_against_runs(src, src_ids, dst, dst_ids)


@needs_triton
@pytest.mark.parametrize("direction", ["in", "out"])
def test_each_destination_block_gets_the_block_its_pair_names(
    host_tier: list[torch.Tensor], direction: str
) -> None:
    """Block b of the source holds b in every element, so each copied block says where it
    came from; the destination's other blocks keep -1."""
    src = torch.arange(SHAPE[0], dtype=torch.float64).view(-1, 1, 1, 1, 1, 1).expand(SHAPE)
    src = src.contiguous()
    dst = torch.full(SHAPE, -1.0, dtype=torch.float64)
    if direction == "in":
        src, dst = host(host_tier, src), dst.to(DEVICE)
    else:
        src, dst = src.to(DEVICE), host(host_tier, dst)
    src_ids, dst_ids = [3, 17, 4, 0], [20, 1, 2, 7]
    copy_scattered(src, src_ids, dst, dst_ids)
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    held = dst.cpu().flatten(1)
    for b in range(SHAPE[0]):
        want = src_ids[dst_ids.index(b)] if b in dst_ids else -1
        assert bool((held[b] == want).all()), f"block {b} holds {held[b].unique().tolist()}"


@needs_triton
def test_nan_payloads_survive_bit_for_bit(host_tier: list[torch.Tensor]) -> None:
    """Signalling and quiet NaNs with distinct payloads, of both signs: a float copy could
    quiet or canonicalize them; an integer copy keeps every bit."""
    payloads = torch.tensor(
        [0x7FF0000000000001, 0x7FF4000000000000, 0x7FF8000000000001, -0x0007FFFFFFFFFFFF],
        dtype=torch.int64,
    )
    src = payloads.repeat(torch.Size(SHAPE).numel() // 4).view(SHAPE).view(torch.float64)
    src = host(host_tier, src.clone())
    dst = torch.zeros(SHAPE, dtype=torch.float64, device=DEVICE)
    assert bool(src.isnan().all())
    copy_scattered(src, [1, 5, 6], dst, [0, 2, 3])
    back = torch.zeros(SHAPE, dtype=torch.float64)
    back = host(host_tier, back)
    copy_scattered(dst, [0, 2, 3], back, [4, 8, 9])
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    for b in (4, 8, 9):
        assert torch.equal(back[b].view(torch.int64), src[1].view(torch.int64))


@needs_triton
@pytest.mark.parametrize(
    ("shape", "dtype", "word"),
    [
        ((6, 1, 2, 3, 1, 5), torch.float32, torch.int64),  # 120 bytes: 15 words of 8
        ((6, 1, 2, 1, 1, 3), torch.bfloat16, torch.int32),  # 12 bytes: 3 words of 4
        ((6, 1, 2, 1, 1, 3), torch.float32, torch.int64),  # 24 bytes: 3 words of 8
        ((6, 1, 1, 1, 1, 3), torch.bfloat16, torch.int16),  # 6 bytes: 3 words of 2
    ],
)
@pytest.mark.parametrize("direction", ["in", "out"])
def test_blocks_of_odd_sizes_copy_in_the_widest_word_that_divides_them_tail_included(
    rng: random.Random,
    host_tier: list[torch.Tensor],
    direction: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    word: torch.dtype,
) -> None:
    src, dst = both_ways(host_tier, direction, dtype, rng.randrange(1 << 30), shape)
    assert device_rows(dst if dst.device == DEVICE else src, DEVICE).dtype == word
    for chunk in (0, 1, 2, 4):  # 0: a whole block a program; else chunks with a short tail
        check_against_runs(src, [0, 2, 5, 3], dst, [4, 1, 0, 5], chunk=chunk)


@needs_triton
def test_a_block_of_an_odd_byte_count_is_copied_bytewise() -> None:
    assert word_of(7) == (1, torch.uint8, "|u1")
    assert word_of(12)[0] == 4 and word_of(16)[0] == 8 and word_of(2)[0] == 2


@needs_triton
def test_no_pairs_copy_nothing_and_return_zero_bytes() -> None:
    src, dst = torch.ones(SHAPE), torch.zeros(SHAPE)
    assert copy_blocks(src, [], dst, [], method="kernel") == 0
    assert not bool(dst.any())


@needs_triton
@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "problem"),
    [
        ([1, 2], [3, 3], "a destination block is named twice"),
        ([1, 24], [3, 4], "a source block id is outside the tensor's 24 blocks"),
        ([1, 2], [3, -1], "a destination block id is outside the tensor's 24 blocks"),
        ([1, 2], [3], "2 source blocks but 1 destination blocks"),
    ],
)
def test_pairs_the_kernel_cannot_copy_are_refused_before_any_block_is_written(
    src_ids: list[int], dst_ids: list[int], problem: str
) -> None:
    src, dst = torch.ones(SHAPE), torch.zeros(SHAPE)
    with pytest.raises(ValueError, match=problem):
        copy_scattered(src, src_ids, dst, dst_ids)
    assert not bool(dst.any())


@needs_triton
def test_copy_blocks_by_kernel_returns_the_bytes_the_runs_return(rng: random.Random) -> None:
    # On the device the kernel runs on: a GPU's, or the CPU's under Triton's interpreter.
    src = random_bits(SHAPE, torch.bfloat16, rng.randrange(1 << 30)).to(DEVICE)
    by_runs, by_kernel = torch.zeros_like(src), torch.zeros_like(src)
    ids = rng.sample(range(SHAPE[0]), 5)
    copied = copy_blocks(src, ids, by_runs, ids)
    assert copy_blocks(src, ids, by_kernel, ids, method="kernel") == copied
    assert copied == 5 * src[0].numel() * 2  # bfloat16: 2 bytes an element
    assert torch.equal(bits_of(by_kernel), bits_of(by_runs))


# The setting: transfer.copy.


def test_auto_copies_by_runs_on_a_cpu_and_runs_is_runs_everywhere() -> None:
    assert resolve_copy("auto", torch.device("cpu")) == "runs"
    assert resolve_copy("runs", torch.device("cpu")) == "runs"
    assert resolve_copy("runs", torch.device("cuda:0")) == "runs"


def test_an_unknown_method_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"^transfer.copy must be auto, runs or kernel, got 'gat"):
        resolve_copy("gather", torch.device("cpu"))


def test_auto_is_the_kernel_on_cuda_only_where_triton_is_installed(monkeypatch) -> None:
    monkeypatch.setattr(copies, "triton_available", lambda: True)
    assert resolve_copy("auto", torch.device("cuda:0")) == "kernel"
    monkeypatch.setattr(copies, "triton_available", lambda: False)
    assert resolve_copy("auto", torch.device("cuda:0")) == "runs"


def test_the_kernel_without_triton_is_refused_naming_the_setting(monkeypatch) -> None:
    monkeypatch.setattr(copies, "triton_available", lambda: False)
    with pytest.raises(ValueError, match=r"^transfer.copy is 'kernel' but Triton is not installed"):
        resolve_copy("kernel", torch.device("cuda:0"))


@needs_triton
def test_the_kernel_on_a_cpu_outside_the_interpreter_is_refused_naming_the_setting(
    monkeypatch,
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_copy("kernel", torch.device("cpu")) == "kernel"
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match=r"'kernel' with the device tier on cpu: .*INTERPRET=1"):
        resolve_copy("kernel", torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^transfer.copy is 'kernel' with the device tier on cpu"):
        check_copy_kernel("cpu")  # the launch's preflight: the same rule, before any process


def test_an_unknown_copy_method_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"transfer\.copy"):
        Config.load(None, ["transfer.copy=memcpy"])
    assert Config.load(None, ["transfer.copy=kernel"]).transfer.copy == "kernel"
    assert Config().transfer.copy == "auto"


# On CUDA (scripts/device-check, step A1): the host tier seen from the device.


@needs_cuda
@needs_triton
def test_on_cuda_the_mapped_host_tier_is_viewed_in_place_not_copied(
    host_tier: list[torch.Tensor],
) -> None:
    h = host(host_tier, torch.zeros(SHAPE, dtype=torch.bfloat16))
    rows = device_rows(h, DEVICE)
    assert rows.device == DEVICE and rows.data_ptr() == h.data_ptr()
    assert tuple(rows.shape) == (SHAPE[0], 2 * 2 * 4 * 2 * 8 * 2 // 8)
    h[3] = 1.0  # written by the CPU, read by the device through the mapping
    assert int(rows[3].count_nonzero()) == rows.shape[1]
    rows[5].fill_(-1)  # written by the device, read by the CPU
    torch.cuda.synchronize(DEVICE)
    assert bool(h[5].view(torch.int16).eq(-1).all())


@needs_cuda
@needs_triton
def test_on_cuda_the_swap_lanes_copy_by_kernel_waits_like_the_runs_when_blocking(
    rng: random.Random, host_tier: list[torch.Tensor]
) -> None:
    src, dst = both_ways(host_tier, "in", torch.bfloat16, rng.randrange(1 << 30))
    expected = dst.clone()
    ids = rng.sample(range(SHAPE[0]), 8)
    copy_blocks(src, ids, expected, ids)
    copy_blocks(src, ids, dst, ids, method="kernel")  # not non_blocking: done on return
    assert torch.equal(bits_of(dst), bits_of(expected))


# Compiled as a GPU would see it (sm_90: H100/H200), with the interpreter off; no GPU needed.
# The pointers carry the 16-byte alignment a launch on aligned tensors specializes them on.
COMPILE_FOR_SM90 = r"""
import os
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from ringfence.actors.kv import block_kernel as bk

kernel = bk._copy_blocks
names = list(kernel.arg_names)
pointers = ("src_ptr", "dst_ptr", "pairs_ptr")
aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in pointers}
# 512 KiB blocks (the 1.1B model's) in int64 words; a 12-byte block in int32, 6 in int16.
for pointer, words, chunk in (("*i64", 65536, 2048), ("*i32", 3, 4), ("*i16", 3, 4)):
    constants = {"WORDS": words, "CHUNK": chunk}
    signature = {"src_ptr": pointer, "dst_ptr": pointer, "pairs_ptr": "*i32"}
    signature.update({n: "constexpr" for n in constants})
    constexprs = {(names.index(n),): v for n, v in constants.items()}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=aligned)
    target = GPUTarget("cuda", 90, 32)
    compiled = triton.compile(source, target=target, options={"num_warps": bk.NUM_WARPS})
    ptx = compiled.asm["ptx"]
    wide = "ld.global.v2.b64" in ptx and "st.global.v2.b64" in ptx
    print(pointer, len(compiled.asm["cubin"]) > 0, wide)
"""


@needs_triton
def test_the_kernel_compiles_for_a_hopper_gpu_with_16_byte_loads_even_without_one() -> None:
    lines = compiled_for_hopper(COMPILE_FOR_SM90)
    assert [line.split()[:2] for line in lines] == [[p, "True"] for p in ("*i64", "*i32", "*i16")]
    assert lines[0] == "*i64 True True", "512 KiB blocks must move in 16-byte loads and stores"

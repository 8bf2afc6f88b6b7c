"""GGUF files written here (a tiny Llama, ``tests/gguf_files.py``): the loader reads back
exactly the weights llama.cpp's layout holds, its ranks slice them as they slice a
safetensors checkpoint, and the preflight refuses a broken file in one line naming the
file and the tensor or key, ``ringfence launch`` exiting 2."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import TINY, permute, tiny_weights, write_tiny
from launching import QUICK, launch_env, launched
from tp_ranks import run_group, steps_of

from ringfence.actors.config import Config
from ringfence.actors.model.checkpoint import checkpoint_fingerprint_id, load_checkpoint
from ringfence.actors.model.decoder import Model
from ringfence.actors.model.gguf_checkpoint import unpermute
from ringfence.actors.preflight import check_model
from ringfence.actors.text.tokenizer import load_tokenizer

gguf = pytest.importorskip("gguf", reason="writes GGUF files")

ENGINE = "runtime.topology=ringfence.actors.engine:TOPOLOGY"
SEED = 7
PROMPT = [257, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 84]


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny(tmp_path / "tiny.gguf", tiny_weights(SEED))


def test_unpermute_inverts_llama_cpps_row_order_of_q_and_k() -> None:
    weight = torch.arange(4 * 16 * 3, dtype=torch.float64).reshape(64, 3)
    permuted = torch.from_numpy(permute(weight.numpy(), 4))
    assert not torch.equal(permuted, weight)
    assert torch.equal(unpermute(permuted, 4), weight)
    # Row 1 of head 0 in llama.cpp's order is row 8 (the second half's first) in ours.
    assert torch.equal(permuted[1], weight[8])


def test_a_float32_file_loads_as_exactly_the_weights_written(tiny: Path) -> None:
    model = load_checkpoint(tiny, dtype=torch.float64)
    loaded = model.state_dict()
    for name, value in tiny_weights(SEED).items():
        assert torch.equal(loaded[name], torch.from_numpy(value).double()), name


def test_a_q8_0_file_loads_as_gguf_dequantizes_it_cast_to_model_dtype(tmp_path: Path) -> None:
    weights = tiny_weights(SEED)
    file = write_tiny(tmp_path / "q8.gguf", weights, quantized=True)
    loaded = load_checkpoint(file, dtype=torch.bfloat16).state_dict()
    kind = gguf.GGMLQuantizationType.Q8_0
    q = weights["model.layers.1.mlp.down_proj.weight"]
    want = gguf.quants.dequantize(gguf.quants.quantize(q, kind), kind)
    got = loaded["model.layers.1.mlp.down_proj.weight"]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, torch.from_numpy(want).to(torch.bfloat16))
    assert 0 < np.abs(want - q).max() < 0.01  # really quantized, and close


def test_the_files_tokenizer_keeps_control_tokens_whole_and_names_bos_and_eos(tiny: Path):
    tokenizer = load_tokenizer(tiny)
    assert tokenizer is not None
    assert tokenizer.encode("<|im_start|>hé<|im_end|>") == [257, 104, 195, 169, 258]
    assert (tokenizer.bos, tokenizer.eos, tokenizer.stop_ids) == (257, 258, (258,))
    assert tokenizer.decode([257, 104, 195, 169, 258]) == "hé"


def test_the_id_is_the_files_digest_and_changes_with_one_weight(tmp_path: Path, tiny: Path):
    weights = tiny_weights(SEED)
    weights["model.norm.weight"][3] += 1e-3
    other = write_tiny(tmp_path / "other.gguf", weights)
    assert checkpoint_fingerprint_id(tiny).startswith("llama-blake2b-")
    assert checkpoint_fingerprint_id(tiny) == checkpoint_fingerprint_id(tiny)
    assert checkpoint_fingerprint_id(tiny) != checkpoint_fingerprint_id(other)


def greedy(model: Model, prompt: list[int], count: int) -> list[int]:
    ids = list(prompt)
    for _ in range(count):
        ids.append(int(model.forward_contiguous(torch.tensor(ids))[-1].argmax()))
    return ids[len(prompt) :]


def test_two_ranks_of_a_gguf_file_compute_the_whole_models_logits(tmp_path: Path, tiny: Path):
    whole = load_checkpoint(tiny, dtype=torch.float64)
    steps = steps_of(PROMPT, greedy(whole, PROMPT, 4))
    sharded = run_group(tmp_path, 2, str(tiny), steps)
    seen: list[int] = []
    for got, step in zip(sharded, steps, strict=True):
        seen += step[0][0]
        want = whole.forward_contiguous(torch.tensor(seen))[-1]
        torch.testing.assert_close(got[-1], want, rtol=1e-9, atol=1e-9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: a GGUF file on cuda")
def test_on_cuda_a_gguf_file_loads_there_and_computes_the_cpu_runs_logits(tiny: Path) -> None:
    cpu = load_checkpoint(tiny, dtype=torch.float64)
    cuda = load_checkpoint(tiny, dtype=torch.float64, device="cuda")
    assert all(p.is_cuda for p in cuda.parameters())
    ids = PROMPT + greedy(cpu, PROMPT, 4)
    want = cpu.forward_contiguous(torch.tensor(ids))
    got = cuda.forward_contiguous(torch.tensor(ids, device="cuda")).cpu()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


# The preflight: each broken file, its exact line in process and from `ringfence launch`.


def truncated(file: Path) -> Path:
    data = file.read_bytes()
    file.write_bytes(data[:-1000])
    return file


def broken_files(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Broken tiny files and the message the preflight gives for each."""
    weights = tiny_weights(SEED)
    f = {
        name: tmp_path / f"{name}.gguf"
        for name in ("missing", "shape", "architecture", "truncated", "type")
    }
    write_tiny(f["missing"], weights, drop=("blk.1.attn_k.weight",))
    write_tiny(f["shape"], weights, replace={"blk.0.attn_k.weight": np.zeros((48, 64), "f4")})
    write_tiny(f["architecture"], weights, architecture="gemma")
    write_tiny(f["type"], weights, replace={"blk.1.ffn_up.weight": np.zeros((128, 64), "f8")})
    size = write_tiny(f["truncated"], weights).stat().st_size
    truncated(f["truncated"])
    end = size - 1000
    output = TINY.vocab_size * TINY.hidden * 4
    return {
        "missing": (f["missing"], "the GGUF file lacks tensors ['blk.1.attn_k.weight']"),
        "shape": (
            f["shape"],
            "tensor 'blk.0.attn_k.weight' has shape [48, 64], the model needs [32, 64] "
            "(rows first)",
        ),
        "architecture": (
            f["architecture"],
            "general.architecture: 'gemma' is not supported; supported: ['llama']",
        ),
        "type": (
            f["type"],
            "tensor 'blk.1.ffn_up.weight' is of type F64, which gguf.quants cannot dequantize",
        ),
        "truncated": (
            f["truncated"],
            "not a GGUF file the gguf package reads: tensor 'output.weight': its data "
            f"[{size - output}, {size}) runs past the end of the file ({end} bytes): truncated?",
        ),
    }


CASES = ("missing", "shape", "architecture", "type", "truncated")


@pytest.mark.parametrize("case", CASES)
def test_the_preflight_names_the_file_and_the_tensor_or_key_of_a_broken_file(
    tmp_path: Path, case: str
) -> None:
    file, said = broken_files(tmp_path)[case]
    with pytest.raises(ValueError) as raised:
        check_model(Config.load(None, [f"model.path={file}"]))
    assert str(raised.value) == f"{file}: {said}"


def test_a_good_file_passes_the_preflight_and_a_missing_one_is_named(tmp_path: Path, tiny):
    check_model(Config.load(None, [f"model.path={tiny}", "parallel.tp_size=2"]))
    missing = tmp_path / "nothing.gguf"
    with pytest.raises(ValueError, match=r"^model.path: .*nothing.gguf: no such GGUF file$"):
        check_model(Config.load(None, [f"model.path={missing}"]))


def test_the_preflight_of_a_gguf_run_imports_no_torch(tiny: Path) -> None:
    code = (
        "import sys\n"
        "from ringfence.actors.config import Config\n"
        "from ringfence.actors.preflight import check_model\n"
        f"check_model(Config.load(None, ['model.path={tiny}']))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=launch_env(), capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def test_a_launch_on_a_broken_file_exits_2_with_one_line_naming_the_file(tmp_path: Path):
    for case, (file, said) in broken_files(tmp_path).items():
        started = time.monotonic()
        (tmp_path / case).mkdir()
        with launched(
            tmp_path / case, ENGINE, f"model.path={file}", "engine.workload=synthetic:multiturn",
            *QUICK,
        ) as run:  # fmt: skip
            assert run.wait() == 2, run.tail()
            stderr = run.stderr()
            assert run.stdout() == ""  # no run announced: no actor was started
            assert not run.run_dir.exists()
        assert stderr.count("\n") == 1, stderr
        assert stderr.startswith(f"ringfence launch: {file}: ") and said in stderr, stderr
        print(f"{case}: refused in {time.monotonic() - started:.1f}s")

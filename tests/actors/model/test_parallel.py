"""Tensor parallelism of the model: each rank's shard, joined by gloo in spawned processes,
computes what the whole model does (and what transformers does) in float64."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from tp_ranks import run_group, steps_of

from ringfence.actors.model.decoder import Model
from ringfence.actors.model.parallel import (
    Shard,
    check_divisible,
    local_shape,
    shard_range,
    split_dim,
    take_shard,
)
from ringfence.actors.model.shape import PRESETS, ModelShape

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 33, 10, 84, 104, 101]


def whole_steps(model: Model, steps: list[list[tuple[list[int], int]]]) -> list[torch.Tensor]:
    """The last logits of each step, from the contiguous forward of the whole model."""
    out, tokens = [], []
    for step in steps:
        ((ids, _start),) = step
        tokens.extend(ids)
        out.append(model.forward_contiguous(torch.tensor(tokens))[-1:])
    return out


def greedy(model: Model, prompt: list[int], count: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(int(model.forward_contiguous(torch.tensor(tokens))[-1].argmax()))
    return tokens[len(prompt) :]


@pytest.mark.parametrize(
    ("preset", "size"),
    # tp 2 runs in CI through the checkpoint test below and the launched tp 2 runs.
    [pytest.param("tiny", 2, marks=pytest.mark.slow), ("tiny-4kv", 4)],
)
def test_shards_joined_by_gloo_compute_the_whole_models_logits(
    tmp_path: Path, preset: str, size: int
) -> None:
    whole = Model.from_preset(preset, torch.float64, 0)
    following = greedy(whole, PROMPT, 6)
    steps = steps_of(PROMPT, following)
    sharded = run_group(tmp_path, size, preset, steps)
    expected = whole_steps(whole, steps)
    assert len(sharded) == len(expected)
    for got, want in zip(sharded, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
        assert int(got[-1].argmax()) == int(want[-1].argmax())


@pytest.mark.parametrize("family", ["Qwen3ForCausalLM"])
def test_checkpoint_shards_give_the_transformers_logits_in_float64(
    tmp_path: Path, family: str
) -> None:
    """Qwen3 with attention biases (q/k/v sliced, o's bias added once after the sum, q/k
    norms per head), loaded rank by rank from the files."""
    pytest.importorskip("transformers")
    from hf_checkpoints import float64_throughout, save_family, transformers_logits

    root = tmp_path / "checkpoint"
    hf = save_family(root, family, seed=7, attention_bias=True)
    float64_throughout(hf)
    steps = steps_of(PROMPT, [5, 6, 7])
    sharded = run_group(tmp_path, 2, str(root), steps)
    tokens = torch.tensor([*PROMPT, 5, 6, 7])
    want = transformers_logits(hf, tokens, torch.float64)
    ends = [len(PROMPT) // 2, len(PROMPT), len(PROMPT) + 1, len(PROMPT) + 2, len(PROMPT) + 3]
    for got, end in zip(sharded, ends, strict=True):
        torch.testing.assert_close(got[-1], want[end - 1], rtol=0, atol=1e-12)


def test_a_rank_reads_only_its_slice_of_a_split_tensor(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from hf_checkpoints import save_family

    from ringfence.actors.model.checkpoint import read_safetensors_header, read_tensor_slice

    root = tmp_path / "checkpoint"
    hf = save_family(root, "LlamaForCausalLM", seed=3)
    entries = read_safetensors_header(root / "model.safetensors")
    state = hf.state_dict()
    for name in ("model.layers.1.mlp.down_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        dim = split_dim(name, 2)
        assert dim is not None
        for rank in range(2):
            where = shard_range(name, entries[name].shape, Shard(rank, 2))
            assert where is not None and where[0] == dim
            got = read_tensor_slice(entries[name], *where)
            assert torch.equal(got, take_shard(name, state[name], Shard(rank, 2))), name


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="no two CUDA devices: the NCCL path of tensor parallelism",
)
def test_cuda_shards_joined_by_nccl_compute_the_whole_models_logits(tmp_path: Path) -> None:
    whole = Model.from_preset("tiny", torch.float64, 0)
    steps = steps_of(PROMPT, greedy(whole, PROMPT, 3))
    sharded = run_group(tmp_path, 2, "tiny", steps, device="cuda")
    for got, want in zip(sharded, whole_steps(whole, steps), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_each_rank_holds_its_heads_and_a_column_or_row_slice() -> None:
    shape = PRESETS["tiny-4kv"]
    local = local_shape(shape, 4)
    assert (local.heads, local.kv_heads, local.intermediate) == (2, 1, 32)
    assert split_dim("model.layers.0.self_attn.q_proj.weight", 2) == 0
    assert split_dim("model.layers.0.self_attn.k_proj.bias", 1) == 0
    assert split_dim("model.layers.0.self_attn.o_proj.weight", 2) == 1
    assert split_dim("model.layers.0.self_attn.o_proj.bias", 1) is None  # added after the sum
    assert split_dim("model.layers.0.mlp.down_proj.weight", 2) == 1
    assert split_dim("model.layers.0.mlp.gate_proj.weight", 2) == 0
    assert split_dim("model.embed_tokens.weight", 2) is None
    assert split_dim("lm_head.weight", 2) is None
    assert shard_range("model.layers.1.mlp.up_proj.weight", (128, 64), Shard(3, 4)) == (0, 96, 32)
    full = torch.arange(12.0).view(3, 4)
    name = "model.layers.0.mlp.down_proj.weight"
    assert take_shard(name, full, Shard(1, 2)).tolist() == [[2, 3], [6, 7], [10, 11]]


def test_a_random_shard_is_the_slice_of_the_whole_models_weights() -> None:
    whole = Model.from_preset("tiny", torch.float64, 0).state_dict()
    for rank in range(2):
        shard = Model.from_preset("tiny", torch.float64, 0, shard=Shard(rank, 2)).state_dict()
        for name, tensor in shard.items():
            assert torch.equal(tensor, take_shard(name, whole[name], Shard(rank, 2))), name


@pytest.mark.parametrize(
    ("shape", "size", "what"),
    [
        (PRESETS["tiny"], 4, "2 KV heads"),
        (PRESETS["tiny"], 3, "2 KV heads"),
        (dataclasses.replace(PRESETS["tiny"], intermediate=129), 2, "129 MLP inner width"),
    ],
)
def test_a_tp_size_that_does_not_divide_the_model_is_refused_naming_both(
    shape: ModelShape, size: int, what: str
) -> None:
    with pytest.raises(
        ValueError, match=rf"parallel.tp_size \({size}\) must divide the model's {what}"
    ):
        check_divisible(shape, size)
    with pytest.raises(ValueError, match=rf"must divide the model's {what}"):
        local_shape(shape, size)

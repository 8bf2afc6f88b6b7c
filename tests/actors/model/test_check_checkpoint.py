"""The launch-time preflight: check_checkpoint reads config.json and safetensors headers only."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
import torch
from hf_checkpoints import FAMILIES, save_family

from ringfence.actors.model.checkpoint import check_checkpoint, load_checkpoint
from ringfence.actors.model.shape import expected_tensors

safetensors_torch = pytest.importorskip("safetensors.torch", reason="rewrites checkpoints")
pytest.importorskip("transformers", reason="checkpoints are saved by transformers")


def rewrite(file: Path, **changes: torch.Tensor | None) -> None:
    """Replace (or, given None, drop) tensors of one safetensors file, keeping the rest."""
    tensors = safetensors_torch.load_file(file)
    for key, tensor in changes.items():
        name = key.replace("__", ".")
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    safetensors_torch.save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_good_checkpoint_of_every_family_passes_with_the_shape_the_loader_uses(
    tmp_path: Path, family: str, tied: bool
) -> None:
    save_family(tmp_path, family, seed=1, tie_word_embeddings=tied)
    shape = check_checkpoint(tmp_path)
    assert shape.family == family and shape.tie_embeddings is tied
    model = load_checkpoint(tmp_path, dtype=torch.float64)
    assert model.config == shape
    state = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    assert state == expected_tensors(shape)


def test_the_check_imports_no_torch(tmp_path: Path) -> None:
    save_family(tmp_path, "Qwen3ForCausalLM", seed=1)
    code = (
        "import sys\n"
        "from ringfence.actors.model.checkpoint import check_checkpoint\n"
        f"print(check_checkpoint({str(tmp_path)!r}).family)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Qwen3ForCausalLM"


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    save_family(tmp_path, "LlamaForCausalLM", seed=1, max_shard_size="50KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(ValueError, match=rf"weight_map names {shards[1].name}, but .* is missing"):
        check_checkpoint(tmp_path)


def test_an_index_that_misplaces_a_tensor_is_named(tmp_path: Path) -> None:
    save_family(tmp_path, "Qwen3ForCausalLM", seed=1, max_shard_size="50KB")
    index = tmp_path / "model.safetensors.index.json"
    raw = orjson.loads(index.read_bytes())
    files = list(raw["weight_map"].values())
    shards = sorted(set(files), key=files.count, reverse=True)  # the fullest shard first
    moved = next(n for n, f in raw["weight_map"].items() if f == shards[0])
    raw["weight_map"][moved] = shards[1]
    index.write_bytes(orjson.dumps(raw))
    with pytest.raises(
        ValueError,
        match=rf"weight_map puts tensor '{re.escape(moved)}' in {shards[1]}, but it is in",
    ):
        check_checkpoint(tmp_path)
    index.write_bytes(b'{"metadata": {}}')
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: malformed index"):
        check_checkpoint(tmp_path)


def test_a_wrong_shape_is_named_with_the_file_and_both_shapes(tmp_path: Path) -> None:
    save_family(tmp_path, "LlamaForCausalLM", seed=1)
    rewrite(
        tmp_path / "model.safetensors",
        model__layers__1__self_attn__k_proj__weight=torch.zeros(64, 64),
    )
    with pytest.raises(
        ValueError,
        match=rf"^{re.escape(str(tmp_path))}/model.safetensors: tensor "
        r"'model.layers.1.self_attn.k_proj.weight' has shape \[64, 64\], "
        r"the model needs \[32, 64\]$",
    ):
        check_checkpoint(tmp_path)


def test_an_unsupported_dtype_is_named_with_the_file(tmp_path: Path) -> None:
    save_family(tmp_path, "Qwen2ForCausalLM", seed=1)
    rewrite(tmp_path / "model.safetensors", model__norm__weight=torch.ones(64, dtype=torch.int8))
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(str(tmp_path))}/model.safetensors: tensor 'model.norm.weight': "
        r"unsupported dtype 'I8'",
    ):
        check_checkpoint(tmp_path)


def test_an_unexpected_tensor_is_named_but_rotary_buffers_are_allowed(tmp_path: Path) -> None:
    save_family(tmp_path, "Qwen2ForCausalLM", seed=1)
    file = tmp_path / "model.safetensors"
    rewrite(file, model__layers__0__self_attn__rotary_emb__inv_freq=torch.ones(8))
    check_checkpoint(tmp_path)
    rewrite(file, model__layers__0__self_attn__o_proj__bias=torch.zeros(64))
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(str(file))}: tensor 'model.layers.0.self_attn.o_proj.bias' is not "
        r"one the Qwen2ForCausalLM model has",
    ):
        check_checkpoint(tmp_path)


def test_a_missing_bias_or_q_norm_is_named(tmp_path: Path) -> None:
    save_family(tmp_path / "qwen2", "Qwen2ForCausalLM", seed=1)
    rewrite(
        tmp_path / "qwen2" / "model.safetensors", model__layers__1__self_attn__v_proj__bias=None
    )
    with pytest.raises(
        ValueError, match=r"lacks tensors \['model.layers.1.self_attn.v_proj.bias'\]"
    ):
        check_checkpoint(tmp_path / "qwen2")
    save_family(tmp_path / "qwen3", "Qwen3ForCausalLM", seed=1)
    rewrite(
        tmp_path / "qwen3" / "model.safetensors", model__layers__0__self_attn__k_norm__weight=None
    )
    with pytest.raises(
        ValueError, match=r"lacks tensors \['model.layers.0.self_attn.k_norm.weight'\]"
    ):
        check_checkpoint(tmp_path / "qwen3")


def test_an_untied_checkpoint_needs_lm_head_and_a_tied_one_may_store_an_equal_copy(
    tmp_path: Path,
) -> None:
    save_family(tmp_path / "untied", "MistralForCausalLM", seed=1)
    rewrite(tmp_path / "untied" / "model.safetensors", lm_head__weight=None)
    with pytest.raises(ValueError, match=r"lacks tensors \['lm_head.weight'\]"):
        check_checkpoint(tmp_path / "untied")
    save_family(tmp_path / "tied", "MistralForCausalLM", seed=1, tie_word_embeddings=True)
    file = tmp_path / "tied" / "model.safetensors"
    embed = safetensors_torch.load_file(file)["model.embed_tokens.weight"]
    rewrite(file, lm_head__weight=embed.clone())
    check_checkpoint(tmp_path / "tied")
    load_checkpoint(tmp_path / "tied")
    rewrite(file, lm_head__weight=embed + 1)
    check_checkpoint(tmp_path / "tied")  # values need the data: the loader checks them
    with pytest.raises(ValueError, match=r"embeddings are tied but lm_head\.weight differs"):
        load_checkpoint(tmp_path / "tied")


def test_an_unknown_architecture_names_the_field_and_the_known_list(tmp_path: Path) -> None:
    save_family(tmp_path, "LlamaForCausalLM", seed=1)
    config = tmp_path / "config.json"
    config.write_text(config.read_text().replace("LlamaForCausalLM", "GemmaForCausalLM"))
    with pytest.raises(
        ValueError,
        match=r"config.json: architectures: expected one of \[\['LlamaForCausalLM'\], "
        r"\['Qwen2ForCausalLM'\], \['Qwen3ForCausalLM'\], \['MistralForCausalLM'\]\], "
        r"got \['GemmaForCausalLM'\]",
    ):
        check_checkpoint(tmp_path)

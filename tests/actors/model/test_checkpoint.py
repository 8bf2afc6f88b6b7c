"""Hugging Face Llama checkpoints: logits against transformers, sharding, errors, tokenizer.

The other families, rope scaling and sliding windows: test_families.py."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from builders import piece
from hf_checkpoints import float64_throughout, save_family, transformers_logits

from ringfence.actors.model.checkpoint import checkpoint_fingerprint_id, load_checkpoint
from ringfence.actors.model.config import ModelConfig as ModelSettings
from ringfence.actors.model.decoder import Model, ModelShape
from ringfence.actors.model.loader import load_model
from ringfence.actors.model.paged import PagedExecutor, make_kv_cache
from ringfence.actors.text.tokenizer import EOS, load_tokenizer

TINY = ModelShape(
    vocab_size=300, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128,
    norm_eps=1e-6,
)  # fmt: skip
SEQ_LEN = 40
TORCH_NAMES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
}


def config_json(*, tied: bool = True, **overrides: Any) -> dict[str, Any]:
    """The config.json that transformers writes for TINY, with overrides."""
    raw: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 300,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    raw.update(overrides)
    return raw


def write_safetensors(file: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Our own writer of the safetensors format (8-byte length, JSON header, raw data)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    chunks: list[bytes] = []
    offset = 0
    for name, tensor in tensors.items():
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        header[name] = {
            "dtype": TORCH_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    encoded = orjson.dumps(header)
    file.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(chunks))


def write_checkpoint(
    root: Path, tensors: dict[str, torch.Tensor], *, tied: bool = True, **overrides: Any
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_bytes(orjson.dumps(config_json(tied=tied, **overrides)))
    write_safetensors(root / "model.safetensors", tensors)
    return root


def tiny_tensors(
    *, tied: bool = True, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Every tensor of a seeded TINY model, as a tied or untied checkpoint stores them."""
    config = ModelShape(**{**{f: getattr(TINY, f) for f in TINY.__slots__}, "tie_embeddings": tied})
    state = Model(config, torch.float32, seed=3).state_dict()
    if tied:
        del state["lm_head.weight"]
    return {name: t.to(dtype).clone() for name, t in state.items()}


def random_ids(seed: int = 0, length: int = SEQ_LEN) -> torch.Tensor:
    print(f"token ids seed {seed}")
    return torch.randint(
        0, TINY.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)
    )


def save_transformers_llama(root: Path, *, tied: bool, max_shard_size: str | None = None) -> Any:
    """A seeded small transformers LlamaForCausalLM with non-trivial weights, saved under root."""
    pytest.importorskip("transformers", reason="comparison needs transformers")
    return save_family(
        root, "LlamaForCausalLM", seed=7, max_shard_size=max_shard_size, tie_word_embeddings=tied
    )


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_transformers_checkpoint_gives_the_transformers_logits(
    tmp_path: Path, tied: bool
) -> None:
    hf = save_transformers_llama(tmp_path, tied=tied)
    ids = random_ids()
    float32 = load_checkpoint(tmp_path, dtype=torch.float32)
    assert float32.config.tie_embeddings is tied
    got = float32.forward_contiguous(ids)
    assert got.dtype == torch.float32
    assert (got - transformers_logits(hf, ids, torch.float32)).abs().max().item() <= 1e-4
    float64 = load_checkpoint(tmp_path, dtype=torch.float64).forward_contiguous(ids)
    # Stock transformers keeps rotary tables and RMSNorm statistics in float32 even in a
    # float64 model, which moves the logits by about 5e-6; computed in float64, they agree.
    assert (float64 - transformers_logits(hf, ids, torch.float64)).abs().max().item() <= 2e-5
    float64_throughout(hf)
    assert (float64 - transformers_logits(hf, ids, torch.float64)).abs().max().item() <= 1e-12


def test_a_sharded_checkpoint_loads_the_same_weights_as_a_single_file(tmp_path: Path) -> None:
    save_transformers_llama(tmp_path / "single", tied=False)
    save_transformers_llama(tmp_path / "sharded", tied=False, max_shard_size="50KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    single = load_checkpoint(tmp_path / "single", dtype=torch.float64).state_dict()
    sharded = load_checkpoint(tmp_path / "sharded", dtype=torch.float64).state_dict()
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[name], sharded[name]) for name in single)


@pytest.mark.parametrize("stored", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_every_stored_dtype_loads_exactly_and_is_cast_to_the_asked_dtype(
    tmp_path: Path, stored: torch.dtype
) -> None:
    tensors = tiny_tensors(dtype=stored)
    model = load_checkpoint(write_checkpoint(tmp_path, tensors), dtype=torch.float64)
    state = model.state_dict()
    assert all(torch.equal(state[name], t.to(torch.float64)) for name, t in tensors.items())
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()


def test_paged_execution_of_a_loaded_model_equals_its_contiguous_forward(tmp_path: Path) -> None:
    model = load_checkpoint(write_checkpoint(tmp_path, tiny_tensors(tied=False), tied=False),
                            dtype=torch.float64)  # fmt: skip
    ids = random_ids(seed=1, length=23).tolist()
    executor = PagedExecutor(model, make_kv_cache(model.config, 16, 4, torch.float64).fill_(0))
    table = [5, 2, 9, 0, 14, 7]
    logits = [
        executor.step([piece(ids[a:b], a, table)], all_logits=True)
        for a, b in ((0, 9), (9, 10), (10, 22), (22, 23))
    ]
    paged = torch.cat([out.all_logits for out in logits if out.all_logits is not None])
    assert (paged - model.forward_contiguous(torch.tensor(ids))).abs().max().item() <= 1e-12


def test_a_missing_tensor_is_named(tmp_path: Path) -> None:
    tensors = tiny_tensors()
    del tensors["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"lacks tensors \['model.layers.1.mlp.up_proj.weight'\]"):
        load_checkpoint(write_checkpoint(tmp_path, tensors))


def test_an_untied_checkpoint_without_lm_head_is_missing_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"lacks tensors \['lm_head.weight'\]"):
        load_checkpoint(write_checkpoint(tmp_path, tiny_tensors(tied=True), tied=False))


def test_an_unexpected_tensor_is_named(tmp_path: Path) -> None:
    tensors = {**tiny_tensors(), "model.layers.2.mlp.up_proj.weight": torch.zeros(2)}
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: tensor 'model.layers.2.mlp.up_proj.weight' is not one the "
        r"LlamaForCausalLM model has",
    ):
        load_checkpoint(write_checkpoint(tmp_path, tensors))


def test_a_wrong_shape_is_named_with_both_shapes(tmp_path: Path) -> None:
    tensors = tiny_tensors()
    tensors["model.norm.weight"] = torch.ones(63)
    with pytest.raises(
        ValueError, match=r"'model.norm.weight' has shape \[63\], the model needs \[64\]"
    ):
        load_checkpoint(write_checkpoint(tmp_path, tensors))


def test_a_truncated_file_names_the_tensor_past_the_end(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, tiny_tensors())
    file = root / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-4])
    past = r"model.safetensors: tensor 'model.norm.weight': data_offsets \[\d+, \d+\] run past"
    with pytest.raises(ValueError, match=past):
        load_checkpoint(root)


def test_a_header_length_past_the_end_of_the_file_is_refused(tmp_path: Path) -> None:
    root = write_checkpoint(tmp_path, tiny_tensors())
    (root / "model.safetensors").write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(ValueError, match=r"header length 1000 runs past the end \(10 bytes\)"):
        load_checkpoint(root)
    (root / "model.safetensors").write_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match=r"2 bytes is too short"):
        load_checkpoint(root)


def test_offsets_that_disagree_with_the_shape_are_refused(tmp_path: Path) -> None:
    header = orjson.dumps({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}})
    root = write_checkpoint(tmp_path, {})
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(24))
    with pytest.raises(ValueError, match=r"tensor 'w': data_offsets \[0, 20\] span 20 bytes, "
                                         r"but shape \[2, 3\] of F32 needs 24"):  # fmt: skip
        load_checkpoint(root)


def test_an_unknown_stored_dtype_is_refused(tmp_path: Path) -> None:
    header = orjson.dumps({"w": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]}})
    root = write_checkpoint(tmp_path, {})
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(2))
    with pytest.raises(ValueError, match=r"tensor 'w': unsupported dtype 'I8'"):
        load_checkpoint(root)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"rope_parameters": {"type": "dynamic", "factor": 2.0}}, "rope_parameters.rope_type"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
            "rope_parameters.low_freq_factor",
        ),
        ({"rope_scaling": {"type": "linear"}}, "rope_scaling.factor"),
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"architectures": None}, "architectures"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"hidden_size": None}, "hidden_size"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers"),
    ],
)
def test_an_unsupported_config_is_refused_naming_the_key(
    tmp_path: Path, override: dict[str, Any], key: str
) -> None:
    root = write_checkpoint(tmp_path, tiny_tensors(), **override)
    with pytest.raises(ValueError, match=rf"config.json: {key}: "):
        load_checkpoint(root)


def test_the_fingerprint_is_stable_and_changes_with_any_weight(tmp_path: Path) -> None:
    tensors = tiny_tensors()
    first = checkpoint_fingerprint_id(write_checkpoint(tmp_path / "a", tensors))
    assert checkpoint_fingerprint_id(write_checkpoint(tmp_path / "b", tensors)) == first
    tensors["model.norm.weight"][0] += 1
    assert checkpoint_fingerprint_id(write_checkpoint(tmp_path / "c", tensors)) != first


def test_the_checkpoint_tokenizer_encodes_and_decodes_like_the_byte_tokenizer(
    tmp_path: Path,
) -> None:
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizer.json needs tokenizers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "kv": 5, "cache": 6}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.decoder = tokenizers.decoders.WordPiece()
    tokenizer.add_special_tokens(["<s>", "</s>"])
    root = write_checkpoint(tmp_path, tiny_tensors())
    assert load_tokenizer(root) is None
    tokenizer.save(str(root / "tokenizer.json"))
    loaded = load_tokenizer(root)
    assert loaded is not None
    assert (loaded.bos, loaded.eos, loaded.vocab_size) == (1, 2, 7)
    assert loaded.encode("hello kv cache") == [3, 5, 6]
    assert loaded.encode("hello world", bos=True) == [1, 3, 4]
    assert loaded.encode("hello moon") == [3, 0]
    assert loaded.decode([1, 3, 4, 2]) == "hello world"


def test_the_worker_loads_model_path_before_the_preset_with_its_id_and_special_tokens(
    tmp_path: Path,
) -> None:
    root = write_checkpoint(tmp_path, tiny_tensors(), eos_token_id=[2, 9])
    settings = ModelSettings(preset="small", path=str(root), dtype="float64")
    model, info = load_model(settings)
    assert model.dtype == torch.float64 and model.config.vocab_size == 300
    assert info.model_id == checkpoint_fingerprint_id(root)
    assert (info.bos_token_id, info.eos_token_id, info.vocab_size) == (1, 2, 300)
    ids = random_ids()
    reference = Model(model.config, torch.float64, seed=3)
    assert torch.equal(model.forward_contiguous(ids), reference.forward_contiguous(ids))
    preset_model, preset_info = load_model(ModelSettings(preset="tiny", seed=4))
    assert preset_info.model_id == "preset-tiny-seed4" and preset_info.eos_token_id == EOS
    assert preset_model.dtype == torch.float32

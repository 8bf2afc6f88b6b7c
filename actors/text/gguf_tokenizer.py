"""A GGUF file's tokenizer, special tokens and chat template, from its metadata.

llama.cpp stores the vocabulary (``tokenizer.ggml.tokens``), the merges, each token's type
(``token_type``: 3 is a control token), the bos/eos/unknown/padding ids and the chat
template (``tokenizer.chat_template``) as metadata. A byte-level BPE vocabulary
(``tokenizer.ggml.model`` = "gpt2") is rebuilt as transformers' GGUF converter builds it
(``integrations/gguf/gguf_tokenizer_mapping.py``: ``byte_level_tokenizer`` and
``add_gguf_special_tokens``): a ``tokenizers`` BPE over the vocabulary spelled in GPT-2's
byte alphabet, the ByteLevel pre-tokenizer (no prefix space) and decoder, and every
control token spelled in that alphabet added whole as a special token. Only the
pre-tokenizers that transformers leaves at GPT-2's split are accepted
(``tokenizer.ggml.pre``); the others split text differently and are refused by name.

Torch-free: the Engine tokenizes prompts. The metadata comes from the cached reader of
``gguf_metadata.py``; ``tokenizer.load_tokenizer`` wraps what is built here, and
``chat.py`` reads the template (``tokenizer.chat_template``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ringfence.actors.text.gguf_metadata import metadata
from ringfence.actors.text.special_tokens import SpecialTokens

BYTE_LEVEL = "gpt2"  # tokenizer.ggml.model of a byte-level BPE vocabulary
# tokenizer.ggml.pre values that split text as GPT-2 does (transformers sets no other split).
PLAIN_SPLITS = (None, "default", "gpt2", "smollm")
CONTROL = 3  # tokenizer.ggml.token_type of a control token (<|im_end|>...)
# Named token -> the metadata key of its id, as transformers' get_gguf_tokenizer reads them.
NAMED_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (``bytes_to_unicode``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(chars.items()))


def _tokens(path: Path) -> list[str]:
    tokens = metadata(path, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError(f"{path}: tokenizer.ggml.tokens: the file has no vocabulary")
    return tokens


def build_tokenizer(path: str | Path) -> Any:
    """The ``tokenizers.Tokenizer`` of the file's byte-level BPE vocabulary; ValueError
    naming the file and the key it refuses."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    path = Path(path)
    model = metadata(path, "tokenizer.ggml.model")
    if model != BYTE_LEVEL:
        raise ValueError(
            f"{path}: tokenizer.ggml.model: {model!r} is not supported; supported: {BYTE_LEVEL!r}"
        )
    pre = metadata(path, "tokenizer.ggml.pre")
    if pre not in PLAIN_SPLITS:
        raise ValueError(
            f"{path}: tokenizer.ggml.pre: {pre!r} is not supported; supported: "
            f"{[p for p in PLAIN_SPLITS if p]}"
        )
    tokens = _tokens(path)
    spelling = byte_alphabet()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ")) for merge in metadata(path, "tokenizer.ggml.merges", [])]
    bpe = BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="")
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    types = metadata(path, "tokenizer.ggml.token_type", [])
    # A control token spelled outside the byte alphabet is a llama.cpp mislabel: transformers
    # skips it (adding it would grow the vocabulary past the model's).
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, kind in zip(tokens, types, strict=False)
        if kind == CONTROL and set(token) <= alphabet
    ]
    tokenizer.add_special_tokens(control)
    return tokenizer


def _named_ids(path: Path, count: int) -> dict[str, int]:
    ids: dict[str, int] = {}
    for name, key in NAMED_IDS.items():
        value = metadata(path, key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < count:
            raise ValueError(f"{path}: {key}: {value!r} is not a token id (0..{count - 1})")
        ids[name] = value
    return ids


def gguf_special_tokens(path: str | Path) -> SpecialTokens:
    """The file's bos and eos ids (eos is its one stop id) and named token strings."""
    file = Path(path)
    tokens = _tokens(file)
    ids = _named_ids(file, len(tokens))
    eos = ids.get("eos_token")
    return SpecialTokens(
        bos=ids.get("bos_token"),
        eos=eos,
        stop_ids=() if eos is None else (eos,),
        strings=MappingProxyType({name: tokens[i] for name, i in ids.items()}),
        add_bos=metadata(file, "tokenizer.ggml.add_bos_token", False) is True,
    )

"""Tokenizers: bytes for the model presets (ids 0..255 are bytes, then bos, eos, pad), and a
checkpoint's ``tokenizer.json`` (through the ``tokenizers`` package) with the same shape,
its special tokens read from the checkpoint's configs (:mod:`.special_tokens`).

Kept apart from the checkpoint loader, which reads tensors: the Engine tokenizes text
prompts and imports no torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import orjson

from ringfence.actors.text.gguf_metadata import is_gguf
from ringfence.actors.text.gguf_tokenizer import build_tokenizer, gguf_special_tokens
from ringfence.actors.text.special_tokens import (
    SpecialTokens,
    read_special_tokens,
    token_entries,
)

NUM_BYTES = 256
BOS = 256  # start of a sequence
EOS = 257  # end of a sequence: generation stops here
PAD = 258  # filler; never produced by encode
VOCAB_SIZE = 259  # bytes + specials; the "tiny" preset's vocab_size


class Tokenizer(Protocol):
    """What the engine and the tools need of a tokenizer."""

    vocab_size: int  # token ids lie in 0 .. vocab_size - 1

    @property
    def bos(self) -> int | None: ...
    @property
    def eos(self) -> int | None: ...
    def encode(self, text: str, *, bos: bool = False) -> list[int]: ...
    @property
    def stop_ids(self) -> tuple[int, ...]: ...
    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids. Stateless; safe to share between threads."""

    bos = BOS
    eos = EOS
    # No default stop ids: a preset's request stops where it asks (its own stop_token_ids).
    stop_ids: tuple[int, ...] = ()
    pad = PAD
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        """The UTF-8 bytes of ``text`` as ids, after ``BOS`` when asked for."""
        ids = list(text.encode("utf-8"))
        return [BOS, *ids] if bos else ids

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of the byte ids; special ids (and any id past them) are skipped, whatever
        ``skip_special``: they have no text.

        Bytes that are not valid UTF-8 (e.g. a sequence cut mid-character) decode as U+FFFD.
        """
        data = bytearray()
        for token in ids:
            if token < 0:
                raise ValueError(f"token id {token} is negative")
            if token < NUM_BYTES:
                data.append(token)
        return data.decode("utf-8", errors="replace")


class CheckpointTokenizer:
    """A checkpoint's ``tokenizer.json`` with ``ByteTokenizer``'s encode/decode shape.

    Read-only after construction; the ``tokenizers`` object is thread-safe for encoding.
    """

    def __init__(self, tokenizer: Any, specials: SpecialTokens, *, file: str = "") -> None:
        self._tokenizer = tokenizer
        self.file = file  # the tokenizer.json it was read from, for error messages
        self.specials = specials  # what the checkpoint's configs say of its special tokens
        self.bos = specials.bos  # start-of-sequence id, if a config names one
        self.eos = specials.eos  # end-of-sequence id, if a config names one
        self.stop_ids = specials.stop_ids  # every id that ends generation
        self.vocab_size: int = tokenizer.get_vocab_size()

    @property
    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` itself (a grammar backend reads its JSON form)."""
        return self._tokenizer

    def encode(self, text: str, *, bos: bool = False) -> list[int]:
        """Ids of ``text`` without the tokenizer's own specials, after ``bos`` when asked for.

        Special tokens written in ``text`` (``<|eot_id|>``) are matched as such, as
        transformers' ``apply_chat_template(tokenize=True)`` does with a rendered chat.
        """
        ids: list[int] = self._tokenizer.encode(text, add_special_tokens=False).ids
        if not bos:
            return ids
        if self.bos is None:
            raise ValueError("the checkpoint's configs name no bos token")
        return [self.bos, *ids]

    def decode(self, ids: Iterable[int], *, skip_special: bool = True) -> str:
        """Text of the ids, special tokens skipped unless ``skip_special`` is False (then
        written as their text: ``/detokenize`` must give back what ``/tokenize`` read)."""
        text: str = self._tokenizer.decode(list(ids), skip_special_tokens=skip_special)
        return text


def _special_id(raw: dict[str, Any], key: str) -> int | None:
    value = raw.get(key)
    if isinstance(value, list):  # some configs list several eos ids; the first is canonical
        value = value[0] if value else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def special_ids(path: str | Path) -> tuple[int | None, int | None]:
    """The ``bos_token_id`` and ``eos_token_id`` that config.json (or a GGUF file's
    metadata) names (None if it does not)."""
    if is_gguf(path):
        specials = gguf_special_tokens(path)
        return specials.bos, specials.eos
    config = Path(path) / "config.json"
    raw = orjson.loads(config.read_bytes()) if config.exists() else {}
    return _special_id(raw, "bos_token_id"), _special_id(raw, "eos_token_id")


def _add_named_tokens(tokenizer: Any, entries: dict[str, Any]) -> None:
    """Add the configs' named tokens that ``tokenizer.json`` lacks as special added tokens.

    transformers does the same when it loads a tokenizer, so such a token written in a
    rendered chat is one id there and must be one id here too.
    """
    from tokenizers import AddedToken

    known = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    for value in entries.values():
        if isinstance(value, str):
            token = AddedToken(value, special=True)
        else:
            flags = ("single_word", "lstrip", "rstrip", "normalized")
            token = AddedToken(
                value["content"], special=True, **{k: bool(value[k]) for k in flags if k in value}
            )
        if token.content not in known:
            tokenizer.add_special_tokens([token])
            known.add(token.content)


def load_tokenizer(path: str | Path) -> CheckpointTokenizer | None:
    """The checkpoint's tokenizer, or None when it has no ``tokenizer.json``; a GGUF file's
    is built from its metadata (``gguf_tokenizer.py``).

    ValueError naming the file when tokenizer.json, or a config it reads its special
    tokens from, does not parse.
    """
    if is_gguf(path):
        return CheckpointTokenizer(build_tokenizer(path), gguf_special_tokens(path), file=str(path))
    root = Path(path)
    file = root / "tokenizer.json"
    if not file.exists():
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ImportError(f"{file} needs the 'tokenizers' package, which is not installed") from exc
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # the package raises a bare Exception for any malformed file
        raise ValueError(f"{file}: not a tokenizer the tokenizers package reads: {exc}") from None
    _add_named_tokens(tokenizer, token_entries(root))
    specials = read_special_tokens(root, tokenizer.token_to_id)
    return CheckpointTokenizer(tokenizer, specials, file=str(file))


def model_tokenizer(path: str) -> Tokenizer:
    """The tokenizer a model samples with: its checkpoint's (``model.path``), else bytes (a
    preset, ``path`` empty, or a checkpoint without a tokenizer.json)."""
    return (load_tokenizer(path) if path else None) or ByteTokenizer()

"""A checkpoint's special tokens, read from its JSON configs the way transformers reads them.

Four files may speak of them; each is optional:

* ``tokenizer_config.json``: the named tokens as strings (``"bos_token": "<s>"``) or
  AddedToken objects (``{"content": "<s>", ...}``), any other ``*_token`` key, and
  ``add_bos_token``. These are what a chat template sees as ``bos_token``, ``eos_token``...
* ``special_tokens_map.json``: the legacy copy of the named tokens. As in transformers it
  is read only when tokenizer_config.json has no ``added_tokens_decoder``, and then its
  values win over tokenizer_config.json's.
* ``generation_config.json``: ``eos_token_id`` (an int or a list): every id that ends
  generation. Without that file, ``config.json``'s ``eos_token_id`` stands in for it
  (transformers builds the generation config from the model config then).
* ``config.json``: ``bos_token_id`` and ``eos_token_id``, used for the single bos and eos
  ids when the tokenizer's configs name no such token.

Pure: reads files, imports no tokenizer; the caller passes how a token string maps to
its id.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import orjson

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
GENERATION_CONFIG = "generation_config.json"
MODEL_CONFIG = "config.json"

TokenToId = Callable[[str], int | None]


def _empty() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True, kw_only=True)
class SpecialTokens:
    """What a checkpoint's configs say of its special tokens. Immutable."""

    bos: int | None = None  # the start-of-sequence id, if any config names one
    eos: int | None = None  # the canonical end-of-sequence id, if any config names one
    # Every id that ends generation, in order: the tokenizer's eos, then the generation
    # config's eos ids (config.json's without a generation_config.json). Empty if none.
    stop_ids: tuple[int, ...] = ()
    # Named token strings (``bos_token`` -> ``"<s>"``...), as a chat template sees them.
    strings: Mapping[str, str] = field(default_factory=_empty)
    add_bos: bool = False  # tokenizer_config.json's add_bos_token


def read_json(file: Path) -> dict[str, Any]:
    """The JSON object in ``file``, or {} if there is no such file; ValueError naming it."""
    if not file.exists():
        return {}
    try:
        raw = orjson.loads(file.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{file}: invalid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(raw).__name__}")
    return raw


def _token_string(value: Any) -> str | None:
    """A token given as a string or as an AddedToken object (with or without ``__type``)."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        content: str = value["content"]
        return content
    return None


def token_entries(root: Path) -> dict[str, Any]:
    """The raw named-token entries (strings or AddedToken objects), after the legacy map."""
    config = read_json(root / TOKENIZER_CONFIG)
    entries: dict[str, Any] = {
        key: value
        for key, value in config.items()
        if key.endswith("_token") and _token_string(value) is not None
    }
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):  # model-specific named tokens, e.g. {"image_token": "<img>"}
        entries.update({k: v for k, v in extra.items() if _token_string(v) is not None})
    if "added_tokens_decoder" not in config:
        legacy = read_json(root / SPECIAL_TOKENS_MAP)
        entries.update({k: v for k, v in legacy.items() if _token_string(v) is not None})
    return entries


def _ids(raw: dict[str, Any], key: str, file: Path) -> list[int]:
    value = raw.get(key)
    values = value if isinstance(value, list) else [] if value is None else [value]
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{file}: {key} must be a token id or a list of them, got {value!r}")
    return values


def read_special_tokens(path: str | Path, token_to_id: TokenToId) -> SpecialTokens:
    """The special tokens of the checkpoint at ``path``; ValueError naming a bad file.

    ``token_to_id`` maps a token string to its id in the checkpoint's tokenizer (None if
    it has none).
    """
    root = Path(path)
    strings = {k: s for k, v in token_entries(root).items() if (s := _token_string(v)) is not None}
    model_file, generation_file = root / MODEL_CONFIG, root / GENERATION_CONFIG
    model = read_json(model_file)
    generation = read_json(generation_file)
    model_bos = _ids(model, "bos_token_id", model_file)
    model_eos = _ids(model, "eos_token_id", model_file)
    if generation_file.exists():
        generation_eos = _ids(generation, "eos_token_id", generation_file)
        generation_bos = _ids(generation, "bos_token_id", generation_file)
    else:
        generation_eos, generation_bos = model_eos, model_bos
    bos = token_to_id(strings["bos_token"]) if "bos_token" in strings else None
    eos = token_to_id(strings["eos_token"]) if "eos_token" in strings else None
    if bos is None:
        bos = next(iter(generation_bos or model_bos), None)
    if eos is None:
        eos = next(iter(generation_eos or model_eos), None)
    stops = dict.fromkeys([*([] if eos is None else [eos]), *generation_eos])  # ordered set
    add_bos = read_json(root / TOKENIZER_CONFIG).get("add_bos_token", False)
    return SpecialTokens(
        bos=bos,
        eos=eos,
        stop_ids=tuple(stops),
        strings=MappingProxyType(strings),
        add_bos=add_bos is True,
    )

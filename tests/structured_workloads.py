"""Workloads of structured outputs for the tiny preset, and the checks of what came out.

Fifty seeded, sampled requests (temperature 1): twenty against a nested JSON schema, fifteen
against a regex and fifteen against a choice; each is short enough for a random model to
finish inside its token budget, since the grammar ends it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import orjson

from ringfence.actors.text.tokenizer import EOS, ByteTokenizer
from ringfence.sched.structured import StructuredOutput

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["alpha", "beta", "gamma"]},
        "inner": {
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "xs": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 99},
                    "maxItems": 3,
                },
                "name": {"type": "string", "pattern": "^[a-z]{1,5}$"},
            },
            "required": ["ok", "xs", "name"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "tag", "inner"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{1,3}(\.[0-9])?"
CHOICES = ["yes", "no", "maybe", "never mind"]
SPECS = {
    "json": StructuredOutput.json_schema(SCHEMA),
    "regex": StructuredOutput(kind="regex", source=REGEX),
    "choice": StructuredOutput.choice(CHOICES),
}
COUNTS = {"json": 20, "regex": 15, "choice": 15}
MAX_TOKENS = 96  # the longest output of SCHEMA is about 90 bytes


def lines(seed: int = 0, counts: dict[str, int] = COUNTS) -> list[dict[str, Any]]:
    """The workload's lines: ``counts`` requests of each kind, prompts of 4 to 10 bytes."""
    out = []
    for kind, count in counts.items():
        spec = SPECS[kind]
        for i in range(count):
            prompt = f"{kind} {seed}:{i}"[: 4 + (i % 7)]
            out.append(
                {
                    "id": f"{kind}{i}",
                    "prompt_token_ids": list(prompt.encode()),
                    "max_tokens": MAX_TOKENS,
                    "temperature": 1.0,
                    "seed": seed * 1000 + i,
                    "structured": {"kind": spec.kind, "source": spec.source},
                }
            )
    return out


def write(path: Path, seed: int = 0, counts: dict[str, int] = COUNTS) -> Path:
    path.write_bytes(b"".join(orjson.dumps(line) + b"\n" for line in lines(seed, counts)))
    return path


def check_output(request_id: str, token_ids: tuple[int, ...] | list[int]) -> str:
    """The output's text, once it is checked: it ended at the grammar's end token and is
    valid for its kind (AssertionError naming the request otherwise)."""
    assert token_ids and token_ids[-1] == EOS, f"{request_id} did not end: {token_ids}"
    text = ByteTokenizer().decode(token_ids[:-1])
    kind = request_id.rstrip("0123456789")
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), f"{request_id}: {text!r} does not match {REGEX}"
    else:
        assert text in CHOICES, f"{request_id}: {text!r} is none of {CHOICES}"
    return text

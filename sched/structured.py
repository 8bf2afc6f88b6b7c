"""A request's structured output: the grammar its tokens must follow (issue 38).

:class:`StructuredOutput` is a field of :class:`~ringfence.sched.sampling.SamplingParams`,
so it travels wherever they do: in the client's ``Submit``, a workload line, and once per
sequence in the step plan's :class:`~ringfence.sched.ops.Opening`. The Worker compiles it
(``ringfence.actors.text.grammars``) and masks the sequence's logits with it. Only its
shape is checked here; whether the schema, regex or grammar compiles is the backend's to
say (the HTTP front end asks it before a request reaches the engine).

Pure: no backend, no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from ringfence.sched.checks import RequestError

Kind = Literal["json", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = get_args(Kind)
FIELD = "structured"  # the SamplingParams field, as errors name it


@dataclass(frozen=True, slots=True, kw_only=True)
class StructuredOutput:
    """What the output must match. A value type: equal specs compile to the same grammar,
    so the Worker caches compiled grammars by spec."""

    # json: ``source`` is a JSON schema (as JSON text); regex: a regular expression the
    # whole output matches; choice: a JSON array of the strings the output is one of;
    # grammar: a Lark grammar, or llama.cpp's GBNF (vLLM's EBNF form).
    kind: Kind
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(
                f"{FIELD}.kind must be one of {', '.join(KINDS)}, got {self.kind!r}", field=FIELD
            )
        if not isinstance(self.source, str) or not self.source:
            raise RequestError(
                f"{FIELD}.source must be a non-empty string, got {self.source!r}", field=FIELD
            )
        if self.kind in ("json", "choice"):
            try:
                value = json.loads(self.source)
            except ValueError as e:
                raise RequestError(f"{FIELD}.source is not JSON: {e}", field=FIELD) from None
            if self.kind == "json" and not isinstance(value, dict | bool):
                raise RequestError(f"{FIELD}.source: a JSON schema is an object", field=FIELD)
            if self.kind == "choice" and not (
                isinstance(value, list) and value and all(isinstance(c, str) for c in value)
            ):
                raise RequestError(
                    f"{FIELD}.source: a choice is a non-empty list of strings", field=FIELD
                )

    @classmethod
    def of(cls, value: object) -> StructuredOutput | None:
        """``value`` as a spec: None, a spec, or a mapping with ``kind`` and ``source`` (a
        workload line's JSON); RequestError otherwise."""
        if value is None or isinstance(value, StructuredOutput):
            return value
        if isinstance(value, Mapping) and set(value) == {"kind", "source"}:
            return cls(kind=value["kind"], source=value["source"])
        raise RequestError(
            f"{FIELD} must be an object with kind and source, got {value!r}", field=FIELD
        )

    @classmethod
    def json_schema(cls, schema: object) -> StructuredOutput:
        """The spec of a JSON schema given as a parsed value (keys kept in order)."""
        return cls(kind="json", source=json.dumps(schema, ensure_ascii=False))

    @classmethod
    def choice(cls, choices: list[str] | tuple[str, ...]) -> StructuredOutput:
        """The spec of a choice among ``choices``."""
        return cls(kind="choice", source=json.dumps(list(choices), ensure_ascii=False))


ANY_JSON_OBJECT = StructuredOutput(kind="json", source='{"type": "object"}')
"""``response_format`` ``json_object``: any JSON object."""

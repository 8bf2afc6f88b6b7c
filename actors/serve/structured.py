"""A request's structured output (issue 38), from whichever field asked for it, checked.

OpenAI's ``response_format`` (``json_object``; ``json_schema`` with its ``schema``, strict or
not: here the output always follows it), vLLM's ``structured_outputs`` (``json``,
``regex``, ``choice``, ``grammar``, ``json_object``) and vLLM's older top-level
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` all become one
:class:`~ringfence.sched.structured.StructuredOutput`. At most one may be given. The
grammar backend compiles it here once (``actors/text/grammars.py``; about 1.5 ms for a
nested schema, and kept by spec), so that a bad schema, regex or grammar is a 400 naming
the field and carrying the backend's complaint before the request reaches the engine. The
server does it on a thread with the rest of the request's prompt (``prompts.prompt_of``):
a large schema takes the backend most of a second (it lets go of the GIL meanwhile), and
the event loop serves every other stream in that time.
"""

from __future__ import annotations

import json
from typing import Any

from ringfence.actors.http.errors import ApiError
from ringfence.actors.serve.api import ChatCompletionRequest, CompletionRequest
from ringfence.actors.text.grammars import problem
from ringfence.sched.checks import RequestError
from ringfence.sched.structured import ANY_JSON_OBJECT, StructuredOutput


def structured_output(
    body: CompletionRequest | ChatCompletionRequest, forced: StructuredOutput | None = None
) -> StructuredOutput | None:
    """The request's structured output, or None; ApiError 400 naming the field at fault.
    ``forced``: the grammar of one call that its ``tool_choice`` forces, which takes no
    other structured output."""
    spec = _asked_output(body)
    if forced is None:
        return spec
    if spec is not None:
        raise ApiError("tool_choice: a forced tool call and a structured output cannot be "
                       "combined", param="tool_choice")  # fmt: skip
    return forced


def _asked_output(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutput | None:
    asked = _asked(body)
    if len(asked) > 1:
        names = ", ".join(field for field, _ in asked)
        field = asked[1][0]
        raise ApiError(f"{field}: give one structured output, got {names}", param=field)
    if not asked:
        return None
    field, spec = asked[0]
    if said := problem(spec):
        raise ApiError(f"{field}: {said}", param=field)
    return spec


def _asked(body: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, StructuredOutput]]:
    """Each (field, spec) the request gives, in the order the fields are documented."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", ANY_JSON_OBJECT))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            field = "response_format.json_schema"
            raise ApiError(f"{field}: type json_schema needs it", param=field)
        field = "response_format.json_schema.schema"
        schema = fmt.json_schema.schema_
        found.append((field, _json(field, True if schema is None else schema)))
    fields: list[tuple[str, str, Any]] = []
    so = body.structured_outputs
    if so is not None:
        if so.json_object:
            found.append(("structured_outputs.json_object", ANY_JSON_OBJECT))
        fields += [
            ("structured_outputs.json", "json", so.json_),
            ("structured_outputs.regex", "regex", so.regex),
            ("structured_outputs.choice", "choice", so.choice),
            ("structured_outputs.grammar", "grammar", so.grammar),
        ]
    fields += [
        ("guided_json", "json", body.guided_json),
        ("guided_regex", "regex", body.guided_regex),
        ("guided_choice", "choice", body.guided_choice),
        ("guided_grammar", "grammar", body.guided_grammar),
    ]
    found += [
        (field, _spec(field, kind, value)) for field, kind, value in fields if value is not None
    ]
    return found


def _spec(field: str, kind: str, value: Any) -> StructuredOutput:
    if kind == "json":
        return _json(field, value)
    try:
        if kind == "choice":
            return StructuredOutput.choice(value)
        return StructuredOutput(kind=kind, source=value)  # type: ignore[arg-type]
    except RequestError as e:
        raise ApiError(f"{field}: {_said(e)}", param=field) from None


def _json(field: str, schema: Any) -> StructuredOutput:
    """A schema given as an object, a boolean or JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ApiError(f"{field}: not JSON: {e}", param=field) from None
    if not isinstance(schema, dict | bool):
        raise ApiError(f"{field}: a JSON schema is an object or a boolean", param=field)
    return StructuredOutput.json_schema(schema)


def _said(error: RequestError) -> str:
    """The error's words without the internal field name it starts with."""
    text = str(error)
    head = f"{error.field}." if error.field else ""
    return text.split(": ", 1)[1] if head and text.startswith(head) and ": " in text else text

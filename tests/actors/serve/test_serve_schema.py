"""`ringfence serve` keeps the promises of its own OpenAPI document, under schemathesis.

schemathesis reads the live server's ``/openapi.json`` and sends each operation requests
generated from it, valid and invalid (the shared tiny server of conftest.py, a 256-token
context so outputs are short); every answer must be no 5xx, have a status and a content type
the document lists, and a body (streams: each event's data) its schema admits; a request the
schema rules out must be refused. The server's semantic limits (an empty prompt, a context
too long, a knob it does not implement) are 400s the document lists, so a valid-looking
request may be refused: that check (``positive_data_acceptance``) is not asked for.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from serving import Server

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
EXAMPLES = 12  # per operation, so the module runs in well under a minute after the start


OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/tokenizer_info"),
]


STREAMED: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "hi"},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
}
EVERY_FIELD = {"max_tokens": 3, "stream": True, "return_token_ids": True,
               "stream_options": {"include_usage": True}}  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_server: Server) -> Server:
    return tiny_server


@pytest.fixture(scope="module")
def api(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def loaded(server: Server, document: dict[str, Any]) -> Any:
    schema = schemathesis.openapi.from_dict(document)
    schema.config.update(base_url=server.url)
    return schema


def conforms(api, method: str, path: str, mode: GenerationMode) -> None:
    """Send ``EXAMPLES`` requests of ``mode`` to one operation; every answer passes CHECKS."""
    operation = api[path][method]

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.generate],
    )
    def each(case) -> None:
        case.call_and_validate(checks=CHECKS)

    each()


@pytest.mark.parametrize(("method", "path"), OPERATIONS)
def test_requests_the_schema_admits_get_answers_it_documents(api, method, path):
    conforms(api, method, path, GenerationMode.POSITIVE)


@pytest.mark.parametrize(("method", "path"), OPERATIONS[:2])
def test_requests_the_schema_rules_out_are_refused_as_documented(api, method, path):
    conforms(api, method, path, GenerationMode.NEGATIVE)


@pytest.mark.parametrize("path", STREAMED)
def test_each_event_of_a_stream_is_checked_and_a_wrong_schema_would_fail(server, api, path):
    body = {**STREAMED[path], **EVERY_FIELD}
    api[path]["POST"].Case(body=body, media_type="application/json").call_and_validate(
        checks=CHECKS
    )
    wrong = copy.deepcopy(api.raw_schema)
    chunk = "CompletionResponse" if path == "/v1/completions" else "ChatCompletionChunk"
    wrong["components"]["schemas"][chunk]["properties"]["model"] = {"type": "integer"}
    case = loaded(server, wrong)[path]["POST"].Case(body=body, media_type="application/json")
    with pytest.raises(FailureGroup) as failed:
        case.call_and_validate(checks=CHECKS)
    assert "SSE event violates schema" in str(failed.value)

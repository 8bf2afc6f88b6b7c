"""The API's OpenAPI document (``GET /openapi.json``): FastAPI's, made true to the server.

FastAPI documents a 422 with its own error body for every route with a body; this server
answers every invalid request with a 400 and OpenAI's error body instead (:mod:`.app`),
so the 422s go, and with them the schemas only they used. The stream chunks, which no
route returns as a model, are added to the components the event streams refer to.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from ringfence.actors.serve.responses import ChatCompletionChunk

REF = "#/components/schemas/{model}"
UNUSED = ("HTTPValidationError", "ValidationError")
EXTRA_MODELS: tuple[type[BaseModel], ...] = (ChatCompletionChunk,)


def install(app: FastAPI) -> None:
    """Serve :func:`document` of ``app`` as its OpenAPI document (built once, then kept)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def document(app: FastAPI) -> dict[str, Any]:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    for operations in doc.get("paths", {}).values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name in UNUSED:
        schemas.pop(name, None)
    for model in EXTRA_MODELS:
        found = model.model_json_schema(ref_template=REF, mode="serialization")
        schemas.update(found.pop("$defs", {}))
        schemas[model.__name__] = found
    return doc

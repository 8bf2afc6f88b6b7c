"""The tools the tool-call tests offer a model: a forecast with a closed argument schema (so
a forced call's arguments are checked exactly) and a call that takes none."""

from __future__ import annotations

from typing import Any

WEATHER_ARGS = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast",
                                      "parameters": WEATHER_ARGS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}},
]  # fmt: skip
# Each tool's name -> the JSON schema its arguments must satisfy.
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

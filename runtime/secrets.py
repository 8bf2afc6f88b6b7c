"""Settings that are secrets (an API key): never written to a run dir, never logged.

A secret is declared with :func:`secret`, which names the environment variable that carries
it. The run dir's ``config.toml`` holds it empty (``config_tables.dump_table``), so the
actors, which load that file, cannot read it there: :func:`export_secrets` takes every secret
set in the config out of it and into the environment, before the supervisor spawns anything
(its children inherit the environment, and nothing else of the parent). An actor reads the
value from the environment (:func:`secret_values`), joined with what the variable held
already: one or several values, comma-separated.

The names of every secret's variable go to the children too (:data:`SECRET_VARS_ENV`), so
that each process's log can redact their values (:func:`redactions`) from every line it
writes, should one ever be passed to it: secrets are kept out of logs by construction, and
the redaction is what catches a mistake.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any, TypeVar, cast

import orjson

from ringfence.runtime.config_tables import SECRET

T = TypeVar("T")
SECRET_VARS_ENV = "RINGFENCE_SECRET_VARS"  # the secrets' variables, comma-separated
MIN_REDACTED = 6  # a shorter value is not looked for in log lines (it would hit at random)
REDACTED = b"[redacted]"


def secret(doc: str, env: str) -> str:
    """A string setting that is a secret, carried to the actors by environment variable ``env``."""
    return dataclasses.field(default="", metadata={"doc": doc, SECRET: env})


def export_secrets(cfg: T, environ: dict[str, str] | None = None) -> T:
    """``cfg`` with every secret emptied, each one's value added to its variable in
    ``environ`` (default ``os.environ``)."""
    env = os.environ if environ is None else environ
    names: set[str] = set()
    exported = _export(cfg, env, names)
    names |= set(env.get(SECRET_VARS_ENV, "").split(",")) - {""}
    env[SECRET_VARS_ENV] = ",".join(sorted(names))
    return exported  # type: ignore[no-any-return]


def redactions(environ: Mapping[str, str] | None = None) -> tuple[bytes, ...]:
    """What a log line must not hold: each value of the variables :data:`SECRET_VARS_ENV`
    names (at least :data:`MIN_REDACTED` characters), as written and as JSON escapes it;
    longest first."""
    env = os.environ if environ is None else environ
    found: set[bytes] = set()
    for var in env.get(SECRET_VARS_ENV, "").split(","):
        for value in secret_values("", var, env) if var else ():
            if len(value) >= MIN_REDACTED:
                found.add(value.encode())
                found.add(orjson.dumps(value)[1:-1])
    return tuple(sorted(found, key=len, reverse=True))


def redact(data: bytes, secrets: tuple[bytes, ...]) -> bytes:
    """``data`` with every one of ``secrets`` replaced by :data:`REDACTED`."""
    for value in secrets:
        if value in data:
            data = data.replace(value, REDACTED)
    return data


def _export(obj: Any, env: Any, names: set[str]) -> Any:
    """``obj`` with its secrets moved into ``env``; every secret's variable (set or not)
    added to ``names``."""
    if isinstance(obj, Mapping):
        items = {k: _export(v, env, names) for k, v in obj.items()}
        if all(items[k] is v for k, v in obj.items()):
            return obj
        return cast(Any, type(obj))(items)
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return obj
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        var = f.metadata.get(SECRET)
        if var:
            names.add(var)
        if var and value:
            env[var] = ",".join(v for v in (env.get(var, ""), value) if v)
            changes[f.name] = ""
        elif dataclasses.is_dataclass(value) or isinstance(value, Mapping):
            new = _export(value, env, names)
            if new is not value:
                changes[f.name] = new
    return dataclasses.replace(obj, **changes) if changes else obj


def secret_values(inline: str, env: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of a secret: ``inline`` (the config's, where an actor was handed it in
    process) and the environment variable ``env``'s, comma-separated, blanks dropped."""
    held = (os.environ if environ is None else environ).get(env, "")
    return [v.strip() for v in f"{inline},{held}".split(",") if v.strip()]

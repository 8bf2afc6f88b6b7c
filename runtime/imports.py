"""Import paths: how the runtime names what lives above it (``"package.module:NAME"``).

The runtime never imports ``ringfence.actors`` statically: a topology, its actors and
channels, the run's config schema and the commands that live with the actors are named by
import path and imported when first used, through :func:`import_target`.
"""

from __future__ import annotations

import importlib
import re

TARGET_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def import_target(path: str) -> object:
    """Import ``"package.module:NAME"`` and return the attribute; ValueError naming the path."""
    if not TARGET_RE.match(path):
        raise ValueError(f"import path {path!r} must look like 'package.module:NAME'")
    module_name, attr = path.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r} for {path!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{module_name!r} has no attribute {attr!r} (from {path!r})") from None

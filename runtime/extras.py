"""The distribution's optional extras, and the one line a command prints when it needs one.

A plain install (``pip install ringfence``: ``install_requires`` only) runs every command
of the ``ringfence`` script: serving included, as with vLLM and SGLang. What is left
optional is what only some runs need: the Redis storage backend, the benchmarks' plots,
peers and reference model. A command that reaches for one of those modules without it
installed ends with exit status 2 and one line naming the extra to install (never a
traceback): ``ringfence.runtime.cli.main`` turns the ``ModuleNotFoundError`` into that line
with :func:`missing_line`, and a check that must run before a run exists (a storage
backend the actors would import in their own processes) calls :func:`require`.

``tests/project/test_plain_install.py`` checks this table against ``setup.cfg``.
"""

from __future__ import annotations

import importlib
from typing import Final

from ringfence.shm.errors import RingfenceError

# Top-level module -> the extra of setup.cfg that installs it.
MODULE_EXTRAS: Final[dict[str, str]] = {
    "redis": "redis",
    "matplotlib": "bench",
    "transformers": "bench",
}


class MissingExtra(RingfenceError, ModuleNotFoundError):
    """A module of an optional extra is not installed; the message names the extra."""


def install_hint(extra: str) -> str:
    """The command that installs ``extra``."""
    return f"pip install 'ringfence[{extra}]'"


def missing_line(exc: ModuleNotFoundError) -> str | None:
    """What to tell the terminal for ``exc``: the missing module and the extra that installs
    it, or None when no extra installs it (a broken install: the error is left as it is)."""
    if isinstance(exc, MissingExtra):
        return str(exc)
    module = (exc.name or "").partition(".")[0]
    extra = MODULE_EXTRAS.get(module)
    if extra is None:
        return None
    return f"needs the '{module}' module, which is not installed: {install_hint(extra)}"


def require(module: str, needed_by: str) -> None:
    """Import ``module`` (a key of :data:`MODULE_EXTRAS`), or raise :class:`MissingExtra`
    saying that ``needed_by`` needs it and which extra installs it."""
    extra = MODULE_EXTRAS[module]
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != module:
            raise  # the module is there but one of its own dependencies is not
        raise MissingExtra(
            f"{needed_by} needs the '{module}' module, which is not installed: "
            f"{install_hint(extra)}",
            name=module,
        ) from None

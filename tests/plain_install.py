"""The ``ringfence`` command as a plain install (``install_requires`` only) would run it,
without a second install: every module that no distribution of ``install_requires`` (or of
what they require, as installed) provides is refused at import, in the command's process and
in every Python process it starts.

The refusal is a ``sitecustomize`` module on ``PYTHONPATH`` that wraps every finder of
``sys.meta_path``; the allowed modules come from ``setup.cfg`` and the installed metadata,
not from a copy. A refused import raises ``ModuleNotFoundError`` naming the module, by
``find_spec`` answering None, exactly as for a module that is not installed, so code that
looks for an optional module and carries on without it (as torch does) still does; each
refused name is written to the file ``RINGFENCE_PLAIN_REFUSED`` names, for the message of a
failing test.
"""

from __future__ import annotations

import configparser
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
# Module name prefixes always allowed: the project, site hooks, the stdlib's build-time data.
ALWAYS = (
    "ringfence",
    "sitecustomize",
    "usercustomize",
    "_distutils_hack",
    "__editable__",
    "_sysconfigdata",
)

SITECUSTOMIZE = f'''\
"""Refuse every module outside the allowed list (tests/plain_install.py)."""
import atexit
import os
import sys

_ALLOWED = frozenset(open(os.environ["RINGFENCE_PLAIN_ALLOWED"]).read().split())
_PREFIXES = {ALWAYS!r}
_REFUSED = os.environ.get("RINGFENCE_PLAIN_REFUSED")


class _PlainInstall:
    """Wraps a meta-path finder: a module a plain install would not have is not found,
    exactly as if it were not installed (``find_spec`` answers None)."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        if top in _ALLOWED or top in sys.stdlib_module_names or top.startswith(_PREFIXES):
            return self._finder.find_spec(name, path, target)
        if _REFUSED:
            with open(_REFUSED, "a") as log:
                log.write(f"{{os.getpid()}} {{name}}\\n")
        return None

    def __getattr__(self, attr):
        return getattr(self._finder, attr)


sys.meta_path[:] = [_PlainInstall(f) for f in sys.meta_path if hasattr(f, "find_spec")]

_LOADED = os.environ.get("RINGFENCE_PLAIN_LOADED")
if _LOADED:
    atexit.register(
        lambda: open(f"{{_LOADED}}.{{os.getpid()}}", "w").write(
            " ".join(sorted({{m.partition(".")[0] for m in sys.modules}}))
        )
    )
'''


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", requirement).lower()


def install_requires() -> list[Requirement]:
    """The requirements of ``setup.cfg``'s ``install_requires``."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    lines = parser["options"]["install_requires"].splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def extra_requires(extra: str) -> list[Requirement]:
    """The requirements of one extra of ``setup.cfg``."""
    parser = configparser.ConfigParser()
    parser.read(ROOT / "setup.cfg")
    lines = parser["options.extras_require"][extra].splitlines()
    return [Requirement(line) for line in lines if line.strip() and not line.startswith("#")]


def allowed_distributions() -> set[str]:
    """``install_requires`` and everything they require, as installed here (normalized)."""
    seen: set[str] = set()
    todo = [(r, frozenset(r.extras)) for r in install_requires()]
    while todo:
        requirement, extras = todo.pop()
        name = _name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(requirement.name) or ():
            needed = Requirement(line)
            markers = [{"extra": e} for e in extras] or [{"extra": ""}]
            if needed.marker is None or any(needed.marker.evaluate(m) for m in markers):
                todo.append((needed, frozenset(needed.extras)))
    return seen


def allowed_modules() -> set[str]:
    """The top-level modules the allowed distributions provide."""
    allowed = allowed_distributions()
    return {
        module
        for module, dists in metadata.packages_distributions().items()
        if any(_name(d) in allowed for d in dists)
    }


def plain_env(folder: Path, loaded: Path | None = None) -> dict[str, str]:
    """The environment of a process that imports as a plain install would: a
    ``sitecustomize`` written to ``folder`` first on ``PYTHONPATH``. With ``loaded``, each
    process writes the top-level modules it had loaded at exit to ``<loaded>.<pid>``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (folder / "allowed.txt").write_text("\n".join(sorted(allowed_modules())))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])),
        "RINGFENCE_PLAIN_ALLOWED": str(folder / "allowed.txt"),
        "RINGFENCE_PLAIN_REFUSED": str(folder / "refused.txt"),
    }
    if loaded is not None:
        env["RINGFENCE_PLAIN_LOADED"] = str(loaded)
    return env


def ringfence(
    *args: str, env: dict[str, str], cwd: Path, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run the console script with ``args`` in ``env``."""
    script = Path(sys.executable).with_name("ringfence")
    return subprocess.run(
        [str(script), *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )

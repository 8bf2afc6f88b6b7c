"""Things a test session makes once and every xdist worker reads: a directory built under a
file lock in the folder the workers share.

Made for costly, read-only references that test files on either worker need (transformers'
load of a GGUF file, a launched run whose logs several modules check). A directory without
its completion mark (a build that failed or was killed) is built again.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

DONE = ".complete"  # written last, inside the directory
LOCK_TIMEOUT_S = 900  # the longest build waited for: a launched run or a model load


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory every worker of this session sees: the parent of a worker's base
    temp under xdist (each worker has its own below it), the base temp otherwise."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]
) -> Path:
    """``shared_root/name``, made by ``build(directory)`` (into an empty directory) by the
    first worker that asks; the others wait on its lock and read what it made. Nothing may
    write into it afterwards."""
    from filelock import FileLock

    out = shared_root(tmp_path_factory) / name
    with FileLock(f"{out}.lock", timeout=LOCK_TIMEOUT_S):
        if not (out / DONE).exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            build(out)
            (out / DONE).write_text("")
    return out

"""A tmpfs mounted for a test, or the test skipped if it cannot be."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

MOUNT_TIMEOUT_S = 30.0


@contextmanager
def mounted_tmpfs(point: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (mount's ``size=``) mounted at ``point`` (created), unmounted after.

    Its root is ``0700``, this user's only, as the local storage backend asks of its directory.

    Skips the test where mounting is not permitted (not root, or no CAP_SYS_ADMIN).
    """
    mount, umount = shutil.which("mount"), shutil.which("umount")
    if os.geteuid() != 0 or mount is None or umount is None:
        pytest.skip("mounting a tmpfs needs root")
    point.mkdir()
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(point)],
        capture_output=True,
        text=True,
        timeout=MOUNT_TIMEOUT_S,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield point
    finally:
        # Lazily: a process of the test that still has a file open there cannot keep it.
        subprocess.run(
            [umount, "-l", str(point)], capture_output=True, timeout=MOUNT_TIMEOUT_S, check=True
        )

"""Compiling a Triton kernel for a Hopper GPU (sm_90: H100, H200) on a machine without one.

The script runs in a fresh interpreter with Triton's interpreter off (a test process may
have it on), and prints one line per compiled variant; :func:`compiled_for_hopper` returns
those lines, or skips where this Triton cannot compile for NVIDIA through the API the
scripts use.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


def compiled_for_hopper(script: str) -> list[str]:
    """The lines ``script`` printed; AssertionError with its stderr if it failed."""
    import triton
    from packaging.version import Version

    if Version(triton.__version__) < Version("3.3"):
        pytest.skip(f"Triton {triton.__version__} compiles through another API")
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this Triton build has no NVIDIA backend")
    run = subprocess.run(
        [sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=240
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()

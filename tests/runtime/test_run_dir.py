"""A run dir is made for its owner alone (0700), whatever the umask."""

from __future__ import annotations

import os
import stat

from ringfence.runtime.run import prepare_run_dir


def test_a_new_run_dir_is_its_owners_alone_whatever_the_umask(tmp_path):
    previous = os.umask(0)
    try:
        assert prepare_run_dir(tmp_path / "deep" / "run") is None
    finally:
        os.umask(previous)
    mode = stat.S_IMODE((tmp_path / "deep" / "run").stat().st_mode)
    assert mode == 0o700, oct(mode)

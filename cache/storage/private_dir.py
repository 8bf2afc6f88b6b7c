"""The local backend's directories are one user's: made ``0700``, refused when not safe.

The processes of a machine that share a storage directory run as one user. Blobs are
created :data:`FILE_MODE` and the directories the backend creates :data:`DIR_MODE`; a root
or fingerprint directory that another user owns, or that its group or others may write to,
is refused at open (:class:`UnsafeDirectory`, naming the path and its mode): whoever can
write there could replace blocks, and without a storage secret a block is taken on its
CRC-32 alone.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import Final

from ringfence.shm.errors import ConfigError

FILE_MODE: Final = 0o600  # a blob: this user's only
DIR_MODE: Final = 0o700  # a directory the backend creates
_OTHERS_WRITE: Final = 0o022  # group or others may write: refused


class UnsafeDirectory(ConfigError):
    """The storage directory is another user's, or others may write to it."""


def make_private_dir(path: str) -> None:
    """Create ``path`` (``0700``) if it is missing; :class:`UnsafeDirectory` if it is another
    user's or its group or others may write to it."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    except FileNotFoundError:  # its parent is missing too: made as by mkdir -p
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, DIR_MODE)
    st = os.stat(path)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.geteuid():
        raise UnsafeDirectory(
            f"cache.storage.path: {path} (mode {mode:04o}) belongs to user {st.st_uid}, not "
            f"to this one ({os.geteuid()}): another user could replace its blocks",
            key="cache.storage.path",
        )
    if mode & _OTHERS_WRITE:
        raise UnsafeDirectory(
            f"cache.storage.path: {path} (mode {mode:04o}) may be written by its group or "
            f"others, who could replace its blocks (chmod go-w {path})",
            key="cache.storage.path",
        )

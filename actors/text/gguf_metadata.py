"""A GGUF file's metadata, read without torch: what the tokenizer and the chat template read.

llama.cpp's single-file checkpoint holds the config, the tokenizer and the chat template as
metadata beside its tensors. The text room reads that metadata here; the model reads the
tensors through the same reader (``actors/model/gguf_checkpoint.py``). The reader is the
``gguf`` package's (a read-only memory map), imported, with numpy, only when a file is
first read; it is cached per file and process.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gguf import GGUFReader

SUFFIX = ".gguf"


def is_gguf(path: str | Path) -> bool:
    """Whether ``model.path`` names a GGUF file (by its suffix) rather than a directory."""
    return Path(path).suffix.lower() == SUFFIX


def _bounded_reader() -> type[GGUFReader]:
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class BoundedReader(GGUFReader):
        """The package's reader, first checking that each tensor's bytes lie in the file:
        on a truncated file its own error would name no tensor. Its memory map is kept as
        a plain array view of the same pages: the reader slices it once or twice per
        string of the vocabulary, and ``np.memmap``'s per-slice bookkeeping took more than
        half of its parse time (2.7 s of SmolLM2's 49,152 tokens and 48,900 merges)."""

        @property  # type: ignore[override]
        def data(self) -> np.ndarray[Any, Any]:
            return self._pages

        @data.setter
        def data(self, value: np.ndarray[Any, Any]) -> None:
            self._pages = value.view(np.ndarray)

        def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
            for field in fields:
                _, name, _, dims, raw_type, offset = field.parts
                block, size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
                count = 1
                for dim in dims.tolist():
                    count *= int(dim)
                begin = int(start_offs + offset[0])
                end = begin + count * size // block
                if end > len(self.data):
                    raise ValueError(
                        f"tensor {bytes(name).decode()!r}: its data [{begin}, {end}) runs past "
                        f"the end of the file ({len(self.data)} bytes): truncated?"
                    )
            super()._build_tensors(start_offs, fields)

    return BoundedReader


@functools.lru_cache(maxsize=4)
def _cached_reader(path: Path, size: int, mtime_ns: int) -> GGUFReader:
    try:
        return _bounded_reader()(path)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"{path}: not a GGUF file the gguf package reads: {exc}") from None


def reader(path: str | Path) -> GGUFReader:
    """The ``gguf`` package's reader of the file (parsed once per process while the file
    is unchanged); ValueError naming the file when it is not one, or is truncated."""
    file = Path(path)
    try:
        stat = file.stat()
    except OSError as exc:
        raise ValueError(f"{file}: cannot read the GGUF file: {exc.strerror}") from None
    return _cached_reader(file, stat.st_size, stat.st_mtime_ns)


def metadata(path: str | Path, key: str, default: Any = None) -> Any:
    """The value of metadata ``key`` (an int, float, bool, str or list), or ``default``."""
    field = reader(path).get_field(key)
    return default if field is None else field.contents()

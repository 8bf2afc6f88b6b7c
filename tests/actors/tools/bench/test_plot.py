"""The benchmarks' ratio plot: a PNG written through matplotlib's Agg canvas."""

from __future__ import annotations

import importlib.util
import struct
import sys

import pytest

from ringfence.actors.tools.bench.plot import INSTALL_HINT, write_ratio_panels, write_ratio_plot

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
IHDR = struct.Struct(">4sII")  # chunk type, width, height (after the 4-byte chunk length)

needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason=f"matplotlib is not installed ({INSTALL_HINT})",
)


@needs_matplotlib
def test_a_ratio_plot_is_a_png_taller_for_more_bars(tmp_path):
    few = tmp_path / "few.png"
    many = tmp_path / "many.png"
    write_ratio_plot(few, [("prefill", 1.25, 0.8)], title="worker")
    ratios = [
        ("prefill", 1.25, 0.8),
        ("decode", 0.6, 0.8),
        ("no target", 2.0, None),
        ("failed", float("nan"), 1.0),
    ]
    write_ratio_plot(many, ratios, title="e2e")
    heights = []
    for path in (few, many):
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE)
        kind, width, height = IHDR.unpack_from(data, len(PNG_SIGNATURE) + 4)
        assert kind == b"IHDR" and width > 0 and height > 0
        heights.append(height)
    assert heights[0] < heights[1]


def png_height(path) -> int:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    return IHDR.unpack_from(data, len(PNG_SIGNATURE) + 4)[2]


@needs_matplotlib
def test_panels_stack_one_per_family_and_empty_ones_are_left_out(tmp_path):
    one, two = tmp_path / "one.png", tmp_path / "two.png"
    fences = [("fence/sync", 1.0, 1.0), ("fence/lock", 0.8, 1.2)]
    write_ratio_panels(one, [("ordering", fences), ("waiting", [])], title="e2e")
    write_ratio_panels(
        two, [("ordering", fences), ("waiting", [("block/poll", 1.1, 1.05)])], title=None
    )
    assert png_height(one) < png_height(two)
    with pytest.raises(ValueError, match="no ratios"):
        write_ratio_panels(tmp_path / "x.png", [("ordering", []), ("waiting", [])], title="t")


def test_no_ratios_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="no ratios"):
        write_ratio_plot(tmp_path / "x.png", [], title="empty")
    assert not (tmp_path / "x.png").exists()


def test_without_matplotlib_the_error_says_what_to_install(tmp_path, monkeypatch):
    # A None entry in sys.modules makes the import raise ImportError.
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(RuntimeError, match=r"ringfence\[bench\]"):
        write_ratio_plot(tmp_path / "x.png", [("a", 1.0, None)], title="t")

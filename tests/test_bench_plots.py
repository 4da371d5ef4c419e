"""`make bench` writes its ratio plots as real PNG files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

_spec = importlib.util.spec_from_file_location(
    "bench_plots", Path(__file__).resolve().parent.parent / "bench" / "plots.py"
)
assert _spec is not None
assert _spec.loader is not None
plots = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plots)
plot_ratios = plots.plot_ratios


def test_plot_ratios_writes_a_png(tmp_path: Path) -> None:
    out = plot_ratios(
        {"SET": [0.5, 1.2], "GET": [0.8, 1.9]}, ["4 KiB", "4 MiB"], tmp_path / "r.png", title="t"
    )
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 5000

"""`bench/bench_gil_twins.py`: the probe compiles, both forms of each operation run on 1 and 2
threads, and the uncontended hand-off is timed."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # (bench/ is beside src/, not installed)

from bench import bench_gil_twins  # noqa: E402

needs_cython = pytest.mark.skipif(
    not (Path(sys.executable).parent / "cythonize").exists() or shutil.which("cc") is None,
    reason="the probe needs Cython and a C compiler (`make setup-dev`)",
)


@needs_cython
def test_every_form_of_every_operation_is_timed(capsys: pytest.CaptureFixture[str]) -> None:
    results = bench_gil_twins.main(["--sizes", "4KiB", "--seconds", "0.05"])
    assert set(results) == {"handoff_ns"} | {
        f"{op} 4096 {form}" for op in bench_gil_twins.OPS for form in ("held", "free")
    }
    assert all(v > 0 for v in results.values())
    out = capsys.readouterr().out
    assert "| compare | 4 KiB | free |" in out
    assert "release and retake" in out

"""`bench/bench_fastpath.py`: per read as before, and `--twins --pipeline K` times both
twins of `run_fast` on one connection, per command, where the compiled one is built."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import compiled_twin

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # (bench/ is beside src/, not installed)

from bench import bench_fastpath  # noqa: E402

compiled, needs_compiled = compiled_twin("epistemic_kvcache.server.resp._fastpath_c")
LABELS = ("EXISTS", "4 KiB GET", "4 KiB SET")


def test_one_command_per_read_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    results = bench_fastpath.main(["--n", "20"])
    assert set(results) == set(LABELS)
    assert all(v > 0 for v in results.values())
    assert "us/read" in capsys.readouterr().out


@needs_compiled
def test_both_twins_per_command_with_pipelining(capsys: pytest.CaptureFixture[str]) -> None:
    results = bench_fastpath.main(["--n", "20", "--pipeline", "4", "--twins"])
    assert set(results) == {f"{label} {twin}" for label in LABELS for twin in ("pure", "compiled")}
    assert all(v > 0 for v in results.values())
    assert "us/command" in capsys.readouterr().out


def test_a_pipeline_beyond_one_inline_read_is_refused() -> None:
    with pytest.raises(SystemExit):
        bench_fastpath.main(["--n", "1", "--pipeline", "65"])

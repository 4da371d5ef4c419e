"""`bench/bench_core.py`: its `--trees` are read as documented, and one small round runs
end to end: redis-server and two trees of ours (one with the store's hot core pure), a
row per command with a ratio and a CPU figure for each server."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # (bench/ is beside src/, not installed)

from bench.bench_core import COMMANDS, parse_trees  # noqa: E402


def test_trees_are_read_with_their_pure_twins() -> None:
    src = str(ROOT / "src")
    assert parse_trees(f"now={src},pure={src}:store_core") == [
        ("now", ROOT / "src", None),
        ("pure", ROOT / "src", "store_core"),
    ]
    for bad in ("now", f"={src}", "now=", f"now={ROOT}"):
        with pytest.raises(SystemExit):
            parse_trees(bad)


@pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None,
    reason="needs redis-server and redis-benchmark",
)
def test_bench_core_prints_a_row_per_command() -> None:
    src = ROOT / "src"
    trees = f"now={src},pure={src}:store_core"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.bench_core",
            "--rounds",
            "1",
            "--scale",
            "0.01",
            "--trees",
            trees,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| ") and "x)" in line]
    assert [row.split(" | ")[0][2:] for row in rows] == [label for label, _, _ in COMMANDS]
    for row in rows:
        assert row.count("x)") == 2  # a ratio per tree
        assert len(row.split(" | ")[-1].split(" / ")) == 3  # CPU: redis-server and both

"""`bench/bench_lookup.py` runs end to end (our server, redis-server, LMCache's clients)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lmcache")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-benchmark") is None, reason="needs redis-benchmark")
def test_bench_lookup_prints_one_row_per_server() -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    out = subprocess.run(
        [sys.executable, "-m", "bench.bench_lookup", "--backends", "memory",
         "--requests", "200", "--lookups", "3", "--keys", "4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [
        ln for ln in out.stdout.splitlines() if ln.startswith("| ours") or ln.startswith("| redis")
    ]
    assert len(rows) == 2, out.stdout
    assert rows[0].startswith("| ours memory @")
    assert rows[1].startswith("| redis-server |")
    assert "mp-resp p50 ms" in out.stdout
    assert "v1-redis p50 ms" in out.stdout

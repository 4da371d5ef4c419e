"""`bench/bench_lookup.py` runs end to end (our server, the floor server, redis-server,
LMCache's clients)."""

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
         "--requests", "200", "--lookups", "3", "--keys", "4", "--floor"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith(("| ours", "| floor", "| redis"))]
    assert len(rows) == 3, out.stdout
    assert rows[0].startswith("| ours memory @")
    assert rows[1].startswith("| floor (uvloop + framer + dict) |")
    head = next(ln for ln in out.stdout.splitlines() if ln.startswith("| server"))
    floor = dict(zip(head.split("|"), rows[1].split("|"), strict=True))
    for path in ("mp-resp", "v1-resp", "v1-redis"):  # each LMCache client ran on the floor
        assert float(floor[f" {path} p50 ms "]) > 0, rows[1]
    assert rows[2].startswith("| redis-server |")
    assert "mp-resp p50 ms" in out.stdout
    assert "v1-redis p50 ms" in out.stdout

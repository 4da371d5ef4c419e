"""`bench/bench_accept.py` runs end to end: a real server with two loops, real connections."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_accept_prints_a_rate_per_round() -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    out = subprocess.run(
        [sys.executable, "-m", "bench.bench_accept", "--n", "50", "--rounds", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith(f"{ROOT}: ")
    rates = line.split(": ", 1)[1].removesuffix(" connections/s").split(" / ")
    assert len(rates) == 2
    assert all(float(r.replace(",", "")) > 0 for r in rates)

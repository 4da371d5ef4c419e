"""Every benchmark `make bench` runs, run small: it exits 0 and prints its table.

The benchmarks with a test of their own (tests/test_bench_accept.py, _core, _fastpath,
_floor, _gil_twins, _lookup; bench_drain in tests/test_server_drain.py) are not repeated
here; tests/test_bench_suite.py checks that
each module `make bench` runs is run by some test. A benchmark is a real run: real
servers (ours, redis-server, a Redis Cluster), real LMCache clients, real processes;
only the volumes and durations are cut. Nothing here asserts a figure (benchmarks are
not tests); what fails is a benchmark that no longer runs, or prints no table.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

redis = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None,
    reason="needs redis-server and redis-benchmark (make sysdeps)",
)
lmcache = pytest.mark.skipif(
    importlib.util.find_spec("lmcache") is None, reason="needs lmcache (make setup-dev)"
)
py_spy = pytest.mark.skipif(
    shutil.which("py-spy", path=str(Path(sys.executable).parent)) is None
    and shutil.which("py-spy") is None,
    reason="needs py-spy (make setup-dev)",
)
root_perf = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("perf") is None, reason="needs root and perf"
)

# (id, module and arguments with {tmp} for a scratch directory, marks)
CASES: list[tuple[str, list[str], list[pytest.MarkDecorator]]] = [
    ("ab", ["bench.bench_ab", "--trees", "now=src", "--sizes", "4KiB", "--repeat", "1",
            "--budget-mib", "4", "--http"], [redis]),
    ("ab-full-cache", ["bench.bench_ab", "--trees", "now=src", "--sizes", "256KiB",
                       "--repeat", "1", "--budget-mib", "8", "--cap-mib", "4"], [redis]),
    ("server", ["bench.bench_server", "--sizes", "4KiB,256KiB", "--budget-mib", "4",
                "--plot", "{tmp}/ratios.png"], [redis]),
    ("cpu", ["bench.bench_cpu", "--sizes", "4KiB", "--op", "get", "--repeat", "1",
             "--budget-mib", "4"], [redis]),
    ("cpu-gil", ["bench.bench_cpu", "--gil", "--sizes", "4MiB", "--conns", "1",
                 "--seconds", "1", "--budget-mib", "16"], [py_spy]),
    ("cpu-perf-stat", ["bench.bench_cpu", "--perf-stat", "--sizes", "256KiB", "--repeat", "1",
                       "--budget-mib", "8"], [redis, root_perf]),
    ("durable", ["bench.bench_durable", "--quick", "--skip", "churn", "--clients", "2",
                 "--blocks", "2000"], [redis]),
    ("durable-churn", ["bench.bench_durable", "--quick", "--skip", "set,reopen"], []),
    ("store", ["bench.bench_store", "--quick", "--budget-mib", "8", "--sizes", "4KiB,4MiB",
               "--index-blocks", "2000", "--dir", "{tmp}"], []),
    ("owned", ["bench.bench_owned", "--sizes", "4KiB", "--repeat", "1"], []),
    ("lmcache", ["bench.bench_lmcache", "--rounds", "1", "--backend", "memory",
                 "--paths", "mp-native,mp-resp"], [redis, lmcache]),
    ("failures", ["bench.bench_failures", "--paths", "a", "--scenarios", "missing",
                  "--limit-s", "20"], [lmcache]),
    ("stall", ["bench.bench_stall", "--block-mib", "8", "--hot-mib", "16", "--rounds", "1",
               "--tail-s", "0.2"], []),
    ("abuse", ["bench.bench_abuse", "--only", "unauth_ping_flood", "--unloaded-s", "0.5",
               "--loaded-s", "1"], []),
    ("scaling-inputs", ["bench.bench_scaling_inputs", "--sizes", "256KiB", "--wires", "resp",
                        "--ops", "get", "--seconds", "1", "--pass-mib", "8"], [py_spy]),
    ("loops", ["bench.bench_loops", "--sizes", "256KiB", "--loops", "1,2", "--procs", "1",
               "--conns", "2", "--budget-mib", "4"], [redis]),
    ("soak", ["bench.bench_soak", "--wire", "http", "--duration-s", "6", "--warmup-s", "2",
              "--window-s", "2", "--max-slope-mib-per-min", "100000", "--out", "{tmp}"], []),
    ("engine", ["bench.bench_engine", "--quick", "--blocks", "200", "--dir", "{tmp}"], []),
    ("context", ["bench.bench_context", "--quick"], []),
    ("cluster", ["bench.bench_cluster", "--seconds", "0.5", "--clients", "1", "--sizes", "4KiB"],
     [redis]),
    ("cluster-clients", ["bench.bench_cluster_clients", "--seconds", "0.2"], [redis]),
    ("fault-run", ["bench.fault_run", "--keys", "30", "--only", "nothing (SIGKILL only)",
                   "--only", "a segment deleted"], []),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "args", [pytest.param(a, marks=m, id=i) for i, a, m in CASES]
)  # fmt: skip
def test_benchmark_runs_small_and_prints_its_table(args: list[str], tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    out = subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert "|---" in out.stdout, out.stdout[-4000:]

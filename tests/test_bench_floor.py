"""`bench/bench_floor.py`: its floor server answers correctly (so what it costs per
request is the cost of correct answers), the whole comparison runs end to end, and
`bench_server.spawn_redis` never takes another process for its redis-server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # (bench/ is beside src/, not installed)

from bench import bench_server  # noqa: E402
from bench.bench_floor import floor_server  # noqa: E402

needs_redis = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-benchmark") is None,
    reason="needs redis-server and redis-benchmark",
)


@pytest.mark.parametrize("variant", ["dict", "blake3", "store", "spin"])
def test_floor_server_answers_the_benchmarks_commands(variant: str) -> None:
    """Every variant answers alike (`store`: through our real memory store)."""
    with floor_server(variant) as port:
        r = redis.Redis(port=port, protocol=2, socket_timeout=30)
        assert r.ping()
        big = os.urandom(300_000)  # above the framer's large-bulk threshold
        assert r.set("big", big)
        assert r.get("big") == big
        assert r.get("absent") is None
        assert r.exists("big", "absent", "big") == 2
        assert r.mset({"m1": b"a", "m2": b"b"})  # (bench_lookup writes its keys so)
        assert r.get("m2") == b"b"
        r3 = redis.Redis(port=port, protocol=3, socket_timeout=30)  # (opens with HELLO 3)
        assert r3.get("m1") == b"a"
        r3.close()
        pipe = r.pipeline(transaction=False)
        for i in range(200):
            pipe.set(f"k{i}", b"v%d" % i)
        for i in range(200):
            pipe.get(f"k{i}")
        out = pipe.execute()
        assert out[:200] == [True] * 200
        assert out[200:] == [b"v%d" % i for i in range(200)]
        with pytest.raises(redis.ResponseError, match="unknown command"):
            r.execute_command("INCR", "k1")
        # a protocol error is answered and the connection closed; the server serves on
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(b"*1\r\n$abc\r\n")
            got = b""
            while chunk := s.recv(4096):
                got += chunk
            assert got.startswith(b"-ERR Protocol error")
        assert r.get("k7") == b"v7"


@needs_redis
def test_spawn_redis_skips_a_port_someone_else_took(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first port it is handed is taken (a listener that never speaks): redis-server
    cannot bind it, and the second port is used."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        real, handed = bench_server.free_port, [taken.getsockname()[1]]
        monkeypatch.setattr(bench_server, "free_port", lambda: handed.pop() if handed else real())
        p, port = bench_server.spawn_redis(tmp_path, ["--save", "", "--appendonly", "no"])
        try:
            assert port != taken.getsockname()[1]
            assert redis.Redis(port=port, protocol=2).ping()
        finally:
            p.terminate()
            p.wait(10)


@pytest.mark.slow
@needs_redis
@pytest.mark.parametrize(("floors", "servers"), [("dict", 3), ("dict,store", 4)])
def test_bench_floor_prints_a_row_per_command(floors: str, servers: int) -> None:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    out = subprocess.run(
        [sys.executable, "-m", "bench.bench_floor", "--rounds", "1", "--scale", "0.01",
         "--floors", floors],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [ln for ln in out.stdout.splitlines() if ln.startswith("| ") and "KiB" in ln]
    rows += [ln for ln in out.stdout.splitlines() if ln.startswith("| EXISTS")]
    assert len(rows) == 8, out.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        # label, rates, a ratio per server but redis, a CPU per server, ours - floor
        assert len(cells) == 2 + (servers - 1) + servers + 1, row
        rates = [float(x.replace(",", "")) for x in cells[1].split(" / ")]
        assert len(rates) == servers, row
        assert all(x > 0 for x in rates), row

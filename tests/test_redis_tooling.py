"""redis-cli's tooling modes against our RESP listener: --bigkeys, --memkeys, --scan,
--stat and --latency, each run for real (redis-tools from Debian), two tenants apart."""

from __future__ import annotations

import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from epistemic_kvcache.server.app import ServerHandle
from servers import running_server

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(shutil.which("redis-cli") is None, reason="redis-cli missing"),
]

TOKEN_A = "tooling-token-a-0123456789"
TOKEN_B = "tooling-token-b-0123456789"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    with running_server(
        tmp_path_factory.mktemp("tooling"),
        tokens={TOKEN_A: "tenant-a", TOKEN_B: "tenant-b"},
        hot_capacity_bytes="64MiB",
        warm_capacity_bytes="32MiB",
    ) as srv:
        handle = srv.handle
        assert handle.resp is not None
        with redis.Redis(port=handle.resp.port, password=TOKEN_A) as a:
            a.set("small", b"s" * 10)
            a.set("medium", b"m" * 1000)
            a.set("large", b"l" * 100_000)
        with redis.Redis(port=handle.resp.port, password=TOKEN_B) as b:
            b.set("other-tenant-huge", b"x" * 500_000)
        yield handle


def cli(server: ServerHandle, *args: str, token: str = TOKEN_A) -> list[str]:
    assert server.resp is not None
    return [
        "stdbuf",
        "-oL",
        "redis-cli",
        "-p",
        str(server.resp.port),
        "--no-auth-warning",
        "-a",
        token,
        *args,
    ]


def run(server: ServerHandle, *args: str, token: str = TOKEN_A) -> str:
    out = subprocess.run(
        cli(server, *args, token=token), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def lines_for(server: ServerHandle, *args: str, seconds: float, want: int) -> list[str]:
    """Run a mode that never ends, collect up to `want` lines for at most `seconds`."""
    p = subprocess.Popen(cli(server, *args), stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    lines: list[str] = []
    deadline = time.monotonic() + seconds
    try:
        while len(lines) < want and time.monotonic() < deadline:
            ready, _, _ = select.select([p.stdout], [], [], 0.2)
            if ready:
                line = p.stdout.readline()
                if not line:
                    break
                lines.append(line.rstrip("\n"))
    finally:
        p.kill()
        p.wait()
        p.stdout.close()
    return lines


def test_bigkeys(server: ServerHandle) -> None:
    out = run(server, "--bigkeys")
    assert "Sampled 3 keys in the keyspace!" in out
    assert "Biggest string found '\"large\"' has 100000 bytes" in out
    assert "3 strings with 101010 bytes" in out
    assert "other-tenant" not in out  # only the caller's keys


def test_memkeys(server: ServerHandle) -> None:
    out = run(server, "--memkeys")
    assert "Sampled 3 keys in the keyspace!" in out
    assert "Biggest string found '\"large\"' has" in out
    biggest = [line for line in out.splitlines() if line.startswith("Biggest string found")]
    size = int(biggest[0].rsplit(" has ", 1)[1].split()[0])
    assert 100_000 < size < 101_000  # value + key + index estimate


def test_scan(server: ServerHandle) -> None:
    assert sorted(run(server, "--scan").split()) == ["large", "medium", "small"]
    assert run(server, "--scan", "--pattern", "m*").split() == ["medium"]
    assert run(server, "--scan", token=TOKEN_B).split() == ["other-tenant-huge"]


def test_stat(server: ServerHandle) -> None:
    lines = lines_for(server, "--stat", "-i", "0.1", seconds=20, want=5)
    assert lines[0].startswith("------- data ------")
    assert lines[1].split()[:5] == ["keys", "mem", "clients", "blocked", "requests"]
    first = lines[2].split()
    keys, mem, clients = first[0], first[1], first[2]
    assert keys == "3"  # this tenant's keys
    # used_memory is the server process's resident memory, as Redis reports its own
    assert mem.endswith(("M", "G")), mem
    assert float(mem[:-1]) > 1, mem
    assert int(clients) >= 1
    requests = [int(line.split()[4]) for line in lines[2:]]
    assert requests == sorted(requests)  # total_commands_processed grows


def test_latency(server: ServerHandle) -> None:
    lines = lines_for(server, "--latency-history", "-i", "1", seconds=20, want=5)
    assert len(lines) >= 3
    for line in lines:
        low, high, avg, samples = line.split()
        assert 0 <= int(low) <= int(high)
        assert float(avg) >= 0
        assert int(samples) >= 1
    summary = lines_for(server, "--latency", seconds=20, want=1)
    assert len(summary) == 1
    assert len(summary[0].split()) == 4


def test_tooling_commands_need_auth(server: ServerHandle, tmp_path: Path) -> None:
    assert server.resp is not None
    out = subprocess.run(
        ["redis-cli", "-p", str(server.resp.port), "--scan"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "NOAUTH" in out.stdout + out.stderr

"""The command as a newcomer meets it: --version, usage errors, start-up checks that
create nothing, TLS file mistakes named, capacity warnings; and the layering that keeps
the client light (no store, no server imports)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import trustme

from epistemic_kvcache import __version__
from epistemic_kvcache.client.stats import KvCacheStats, TierOccupancy
from epistemic_kvcache.config import load_config
from epistemic_kvcache.shared import STATS_FIELDS, TIER_FIELDS
from epistemic_kvcache.store.api import StoreStats, TierStats

TOKEN = "t" * 32


def _env() -> dict[str, str]:
    """This environment without any of the server's variables."""
    drop = ("EPISTEMIC_GRAPH_KVCACHE_", "GRAPH_SERVICE_PERSIST_DIR")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)} | {
        "PYTHONUNBUFFERED": "1"
    }


def cli(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "epistemic_kvcache", *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_version(tmp_path: Path) -> None:
    proc = cli(tmp_path, "--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"epistemic-kvcache {__version__}"


def test_bad_flag_after_serve_prints_serve_usage(tmp_path: Path) -> None:
    proc = cli(tmp_path, "serve", "--no-such-flag")
    assert proc.returncode == 2
    assert proc.stderr.startswith("usage: epistemic-kvcache serve ")
    assert proc.stderr.rstrip().endswith(
        "epistemic-kvcache serve: error: unrecognized arguments: --no-such-flag"
    )
    assert list(tmp_path.iterdir()) == []


def test_persist_dir_naming_a_file(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    proc = cli(tmp_path, "serve", "--persist-dir", "afile")
    assert proc.returncode == 2
    assert proc.stderr == (
        "epistemic-kvcache serve: error: invalid persist_dir: not a directory (got 'afile')\n"
    )


def test_refused_bind_creates_nothing(tmp_path: Path) -> None:
    proc = cli(tmp_path, "serve", "--addr", "0.0.0.0:0", "--resp-addr", "off")
    assert proc.returncode == 2
    assert "invalid addr: refusing to listen on 0.0.0.0:0" in proc.stderr
    assert list(tmp_path.iterdir()) == [], "no data dir, no generated token"
    proc = cli(tmp_path, "serve", "--addr", "127.0.0.1:0", "--resp-addr", "0.0.0.0:0")
    assert proc.returncode == 2
    assert proc.stderr.startswith("epistemic-kvcache serve: error: invalid resp_addr: refusing")
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def pems(tmp_path: Path) -> dict[str, Path]:
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    other = ca.issue_cert("127.0.0.2")
    files = {
        "cert": tmp_path / "server.pem",
        "key": tmp_path / "server.key",
        "other_key": tmp_path / "other.key",
        "ca": tmp_path / "ca.pem",
    }
    cert.cert_chain_pems[0].write_to_path(str(files["cert"]))
    cert.private_key_pem.write_to_path(str(files["key"]))
    other.private_key_pem.write_to_path(str(files["other_key"]))
    ca.cert_pem.write_to_path(str(files["ca"]))
    return files


def _serve_tls(tmp_path: Path, cert: Path, key: Path, *extra: str) -> str:
    proc = cli(
        tmp_path,
        "serve",
        "--token",
        TOKEN,
        "--persist-dir",
        "data",
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        *extra,
    )
    assert proc.returncode == 2, proc.stderr
    assert not (tmp_path / "data").exists()
    assert proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr


def test_swapped_cert_and_key(tmp_path: Path, pems: dict[str, Path]) -> None:
    err = _serve_tls(tmp_path, pems["key"], pems["cert"])
    assert "invalid tls_cert/tls_key: swapped" in err
    assert "PEM lib" not in err


def test_key_of_another_certificate(tmp_path: Path, pems: dict[str, Path]) -> None:
    err = _serve_tls(tmp_path, pems["cert"], pems["other_key"])
    assert "invalid tls_key:" in err
    assert "the key does not belong to the certificate" in err


def test_missing_tls_file_names_the_setting(tmp_path: Path, pems: dict[str, Path]) -> None:
    err = _serve_tls(tmp_path, pems["cert"], tmp_path / "nope.key")
    assert "invalid tls_key: file not found" in err
    err = _serve_tls(tmp_path, pems["cert"], pems["key"], "--tls-client-ca", "missing-ca.pem")
    assert "invalid tls_client_ca: file not found (got 'missing-ca.pem')" in err


def test_client_ca_without_certificates(tmp_path: Path, pems: dict[str, Path]) -> None:
    err = _serve_tls(tmp_path, pems["cert"], pems["key"], "--tls-client-ca", str(pems["key"]))
    assert "invalid tls_client_ca: no usable CA certificate" in err


def test_capacity_warnings(tmp_path: Path) -> None:
    c = load_config({"backend": "memory", "cold_capacity_bytes": "10GiB"}, {})
    assert any("cold_capacity_bytes is ignored with backend 'memory'" in w for w in c.warnings)
    c = load_config({"backend": "memory"}, {})
    assert not any("cold_capacity_bytes" in w for w in c.warnings)
    c = load_config({"hot_capacity_bytes": "1000TiB", "persist_dir": str(tmp_path / "d")}, {})
    assert any(
        "exceed this machine's memory" in w or "exceed this process's cgroup memory limit" in w
        for w in c.warnings
    )
    c = load_config({"cold_capacity_bytes": "100000TiB", "persist_dir": str(tmp_path / "d")}, {})
    assert any("exceeds the file system of persist_dir" in w for w in c.warnings)


def test_serve_without_the_server_extra_says_so(tmp_path: Path) -> None:
    # Simulate a client-only install: hide one server dependency from the import system.
    code = (
        "import sys; sys.modules['lmdb'] = None\n"
        "import importlib.util as u; real = u.find_spec\n"
        "u.find_spec = lambda n, *a: None if n == 'lmdb' else real(n, *a)\n"
        "from epistemic_kvcache.cli import main\n"
        f"sys.exit(main(['serve', '--token', {TOKEN!r}, '--addr', '127.0.0.1:0',"
        " '--resp-addr', 'off']))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert "needs the 'server' extra (lmdb not installed)" in proc.stderr
    assert "pip install 'epistemic-kvcache[server] @ git+https://github.com/" in proc.stderr
    assert "not on PyPI yet" in proc.stderr


# -- layering ---------------------------------------------------------------------------

HEAVY = ("lmdb", "blosc2", "numpy", "uvloop", "httptools", "prometheus_client", "jwt")


def _imported_after(statement: str) -> list[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return list(json.loads(out))


@pytest.mark.parametrize("module", ["epistemic_kvcache.client", "epistemic_kvcache.config"])
def test_light_modules_import_no_store_and_no_server(module: str) -> None:
    mods = _imported_after(f"import {module}")
    bad = [
        m
        for m in mods
        if m.split(".")[0] in HEAVY
        or m.startswith(("epistemic_kvcache.store", "epistemic_kvcache.server"))
    ]
    assert bad == []


def test_stats_fields_defined_once() -> None:
    names = [f.name for f in STATS_FIELDS]
    store = [f.name for f in dataclasses.fields(StoreStats) if f.name not in ("tiers", "extra")]
    client = [
        f.name
        for f in dataclasses.fields(KvCacheStats)
        if f.name not in ("namespace", "tiers", "raw")
    ]
    assert store == names
    assert client == names
    tier_names = [f.name for f in TIER_FIELDS]
    assert [f.name for f in dataclasses.fields(TierStats)] == tier_names
    assert [f.name for f in dataclasses.fields(TierOccupancy)] == [*tier_names, "compression_ratio"]
    # The server's JSON parses into the client's view field for field.
    stats = StoreStats(**{n: i + 1 for i, n in enumerate(names)})
    stats.tiers["hot"] = TierStats(1, 2, 3, 4, 5)
    parsed = KvCacheStats.from_json(stats.to_dict())
    assert [getattr(parsed, n) for n in names] == list(range(1, len(names) + 1))
    assert parsed.tiers["hot"] == TierOccupancy(1, 2, 3, 4, 5, 0.5)

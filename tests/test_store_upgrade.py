"""Upgrades: every store directory a release wrote (tests/data/store-v*) opens with the
current code and serves every key bit-exact; a store a newer release wrote is refused.

`tests/store_fixture.py` writes the fixture with the code of its release (`python
tests/store_fixture.py`); each release commits its own directory next to the earlier
ones, and none is ever regenerated. Each directory's `fixture.json` says what it must
serve (each key's size and BLAKE3, the deleted keys, a pinned key, a snapshot taken
before a replacement). The checks run on a copy (opening writes lock files and a
checkpoint): in process with the index as it was written, from the log alone (the index
rebuilt), with `store check`, and through a real server process over HTTP.

The downgrade rule (docs/store.md): a store whose index or log a newer release wrote
is refused at open with a message naming the formats, and nothing in it is changed.
Before, a newer log's records read as damage (every key lost on a rebuild) and a newer
index's refusal named `epistemic-kvcache store upgrade`, a command that does not exist.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import shutil
import struct
import urllib.parse
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blake3
import pytest

from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import SharedKvStoreBackend, records, tools
from epistemic_kvcache.store.index import FORMAT_VERSION, open_index
from servers import TOKEN, ServeProcess

DATA = Path(__file__).resolve().parent / "data"
FIXTURES = sorted(DATA.glob("store-v*"))
OPTIONS = StoreOptions(hot_capacity_bytes=1 << 20, warm_capacity_bytes=0)
TOKEN_B = "tenant-b-token-0123456789abcdef"


def test_this_release_has_a_fixture() -> None:
    from epistemic_kvcache._version import __version__

    assert (DATA / f"store-v{__version__}" / "fixture.json").is_file()


def spec(fixture: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((fixture / "fixture.json").read_text())
    return doc


def copy_of(fixture: Path, tmp_path: Path) -> Path:
    dst = tmp_path / fixture.name
    shutil.copytree(fixture, dst)
    return dst


def same(value: Any, want: list[Any]) -> bool:
    data = bytes(value)
    return [len(data), blake3.blake3(data).hexdigest()] == want


def assert_serves(store: SharedKvStoreBackend, doc: dict[str, Any]) -> None:
    for ns, keys in doc["keys"].items():
        assert sorted(store.keys(ns, limit=1000)) == sorted(keys), ns
        for key, want in keys.items():
            value = store.get(ns, key)
            assert value is not None, (ns, key)
            assert same(value, want), (ns, key)
    for ns, keys in doc["deleted"].items():
        for key in keys:
            assert store.get(ns, key) is None, (ns, key)
    snap = doc["snapshot"]
    for key, want in snap["keys"].items():
        value = store.snapshot_get(snap["tenant"], snap["id"], key)
        assert value is not None, key
        assert same(value, want), key
    ns, key = doc["pinned"]
    assert store.exists(ns, key)
    assert not store.evict(ns, key)  # its pin survived: a pinned block is never evicted
    report = store.check(deep=True)
    assert report.ok, report


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.name for f in FIXTURES])
def test_an_earlier_store_opens_and_serves_every_key(fixture: Path, tmp_path: Path) -> None:
    path = copy_of(fixture, tmp_path)
    doc = spec(path)
    with SharedKvStoreBackend(path, OPTIONS) as store:
        assert_serves(store, doc)
    summary = tools.check(path)
    assert summary.ok, summary.lines()
    with SharedKvStoreBackend(path, OPTIONS) as store:  # and again, after our own close
        assert_serves(store, doc)


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.name for f in FIXTURES])
def test_an_earlier_log_alone_rebuilds_into_the_same_store(fixture: Path, tmp_path: Path) -> None:
    path = copy_of(fixture, tmp_path)
    shutil.rmtree(path / "index")
    rebuild = dataclasses.replace(OPTIONS, rebuild_index=True)
    with SharedKvStoreBackend(path, rebuild) as store:  # no index: built from the log
        assert_serves(store, spec(path))


def http_get(port: int, token: str, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", path, headers={"Authorization": f"Bearer {token}"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@pytest.mark.parametrize("fixture", FIXTURES, ids=[f.name for f in FIXTURES])
def test_an_earlier_store_serves_through_a_real_server(fixture: Path, tmp_path: Path) -> None:
    path = copy_of(fixture, tmp_path)
    doc = spec(path)
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN_B} tenant-b\n")
    tokens.chmod(0o600)
    tenant_token = {"default": TOKEN, "tenant-b": TOKEN_B}
    assert set(doc["keys"]) == set(tenant_token)
    srv = ServeProcess(path, "--token-file", str(tokens), backend="durable", resp=False)
    try:
        port = srv.http_port
        for ns, keys in doc["keys"].items():
            for key, want in keys.items():
                status, body = http_get(
                    port, tenant_token[ns], "/kv/" + urllib.parse.quote(key, safe="")
                )
                assert status == 200, (ns, key)
                assert same(body, want), (ns, key)
        for ns, keys in doc["deleted"].items():
            for key in keys:
                assert http_get(port, tenant_token[ns], f"/kv/{key}")[0] == 404
        snap = doc["snapshot"]
        for key, want in snap["keys"].items():
            path_ = f"/kv/snapshot/{snap['id']}/" + urllib.parse.quote(key, safe="")
            status, body = http_get(port, tenant_token[snap["tenant"]], path_)
            assert status == 200, key
            assert same(body, want), key
    finally:
        srv.stop()
    assert srv.proc.returncode == 0, "".join(srv.output)
    log = "".join(srv.output)
    assert "ERROR" not in log, log
    assert "dropping" not in log, log


# -- a store a newer release wrote ------------------------------------------------------


def newest(tmp_path: Path) -> Path:
    return copy_of(FIXTURES[-1], tmp_path)


def files_of(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name not in ("lock.mdb", "LOCK")
    }


def test_an_index_from_a_newer_release_is_refused(tmp_path: Path) -> None:
    path = newest(tmp_path)
    ix = open_index(path / "index", 1 << 20)
    with ix.env.begin(write=True) as txn:
        txn.put(b"format", str(int(FORMAT_VERSION) + 1).encode(), db=ix.db_meta)
    ix.close()
    before = files_of(path)
    with pytest.raises(ConfigurationError, match="written by a newer release") as err:
        SharedKvStoreBackend(path, OPTIONS)
    assert "store upgrade" not in str(err.value)
    assert f"this release reads format {FORMAT_VERSION.decode()}" in str(err.value)
    assert files_of(path) == before  # nothing changed


def test_a_log_from_a_newer_release_is_refused_not_read_as_damage(tmp_path: Path) -> None:
    path = newest(tmp_path)
    seg = sorted((path / "segments").glob("*.seg"))[0]
    raw = bytearray(seg.read_bytes())
    hlen = records.header_length(raw)
    raw[4] = records.VERSION + 1  # the first record's format byte
    struct.pack_into(">I", raw, 12, 0)
    struct.pack_into(">I", raw, 12, zlib.crc32(raw[:hlen]))
    seg.write_bytes(bytes(raw))
    shutil.rmtree(path / "index")  # no index to stop it first: the log itself is checked
    before = files_of(path)
    attempts: list[Callable[[], object]] = [
        lambda: SharedKvStoreBackend(path, OPTIONS),
        lambda: SharedKvStoreBackend(path, dataclasses.replace(OPTIONS, rebuild_index=True)),
        lambda: tools.check(path),
    ]
    for attempt in attempts:
        with pytest.raises(ConfigurationError, match="written by a newer release") as err:
            attempt()
        assert f"record format {records.VERSION + 1}" in str(err.value)
    assert files_of(path) == before

"""The committed store directory that every later release must open and serve.

Usage: python tests/store_fixture.py [DIR]   (default: tests/data/store-v<version>)

Writes a small durable store with this version's code, the way storage engines keep a
database written by each release to test format compatibility: two tenants, keys of a
few sizes, one replaced, one deleted, one pinned, two keys holding the same bytes (one
blob, two references), a key longer than an LMDB key (its index row is hashed), and a
snapshot taken before the replacement (it keeps the old bytes). The store is closed
cleanly (its index is current, no zeroed space after the log's end); the LOCK file and
LMDB's lock files are left out (a running store's; opening makes them). `fixture.json`
records the version and formats that wrote it and what it must serve (each key's size
and BLAKE3, the deleted keys, the snapshot's id and keys).
`tests/test_store_upgrade.py` opens the committed copies with the current code and
serves every key bit-exact, in process and through a real server.

Everything the store holds is a function of `EXPECTED` and `SNAPSHOT`: regenerating it
gives the same keys and bytes (the store id and snapshot id are new each time).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import blake3

from epistemic_kvcache._version import __version__
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import SharedKvStoreBackend, records
from epistemic_kvcache.store.index import FORMAT_VERSION

HERE = Path(__file__).resolve().parent
DATA = HERE / "data"
OPTIONS = StoreOptions(hot_capacity_bytes=1 << 20, warm_capacity_bytes=0)
LONG_KEY = "long/" + "k" * 600  # over LMDB's 511-byte key limit


def content(name: str, size: int) -> bytes:
    return blake3.blake3(name.encode()).digest(length=size)


EXPECTED: dict[str, dict[str, bytes]] = {
    "default": {
        "model@00000000@0@aaaa": content("a", 1024),
        "model@00000000@0@bbbb": content("b2", 1000),  # replaced (was content("b1", 2048))
        "model@00000000@0@cccc": content("a", 1024),  # the same bytes as aaaa
        "pinned": content("p", 300),
        LONG_KEY: content("long", 700),
    },
    "tenant-b": {
        "x": content("x", 3000),
        "y": b"",  # an empty value
    },
}
DELETED = {"default": ["deleted"], "tenant-b": ["gone"]}
SNAPSHOT = {  # (tenant, key) -> bytes as the snapshot captured them
    ("default", "model@00000000@0@aaaa"): content("a", 1024),
    ("default", "model@00000000@0@bbbb"): content("b1", 2048),
}
PINNED = ("default", "pinned")


def digest(value: bytes) -> list[object]:
    """How `fixture.json` names a value: [its size, its BLAKE3 in hex]."""
    return [len(value), blake3.blake3(value).hexdigest()]


def build(path: Path) -> dict[str, object]:
    """Write the store into `path` (which must not exist); returns `fixture.json`."""
    with SharedKvStoreBackend(path, OPTIONS) as store:
        d = EXPECTED["default"]
        store.put("default", "model@00000000@0@aaaa", d["model@00000000@0@aaaa"])
        store.put("default", "model@00000000@0@bbbb", content("b1", 2048))
        store.put("default", "deleted", content("d", 512))
        snap = store.snapshot_create(
            "default", keys=["model@00000000@0@aaaa", "model@00000000@0@bbbb"]
        )
        store.put("default", "model@00000000@0@bbbb", d["model@00000000@0@bbbb"])
        store.put("default", "model@00000000@0@cccc", d["model@00000000@0@cccc"])
        store.put("default", "pinned", d["pinned"])
        store.pin(*PINNED)
        store.put("default", LONG_KEY, d[LONG_KEY])
        assert store.delete("default", "deleted")
        for key, value in EXPECTED["tenant-b"].items():
            store.put("tenant-b", key, value)
        store.put("tenant-b", "gone", content("g", 64))
        assert store.delete("tenant-b", "gone")
    for lock in ("LOCK", "index/lock.mdb", "epochs/lock.mdb"):  # a running store's
        (path / lock).unlink(missing_ok=True)
    meta: dict[str, object] = {
        "version": __version__,
        "record_format": records.VERSION,
        "index_format": FORMAT_VERSION.decode(),
        # what the store must serve, as (size, BLAKE3): a later generator may write
        # other content, and this directory still says what it holds
        "keys": {ns: {k: digest(v) for k, v in keys.items()} for ns, keys in EXPECTED.items()},
        "deleted": DELETED,
        "pinned": list(PINNED),
        "snapshot": {
            "id": snap.id,
            "tenant": "default",
            "keys": {key: digest(v) for (_ns, key), v in SNAPSHOT.items()},
        },
    }
    (path / "fixture.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str]) -> int:
    target = Path(argv[0]) if argv else DATA / f"store-v{__version__}"
    if target.exists():
        shutil.rmtree(target)
    build(target)
    files = sorted(p for p in target.rglob("*") if p.is_file())
    for p in files:
        print(f"{p.stat().st_size:8d}  {p.relative_to(target)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

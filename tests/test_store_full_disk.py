"""A full disk comes back when data is deleted, whatever the deleted keys' layout.

A real server on a real 64 MiB tmpfs is filled until PUTs fail with 507 (disk full);
then every other key is deleted (half the bytes, interleaved, so no segment empties).
Within a deadline, new PUTs must succeed again and `/readyz` must say ready, without a
restart; every key not deleted still reads back exactly. With `--cold-capacity-bytes`
above the file system's size (the file system is the limit) and below it (the cold
capacity is).
"""

from __future__ import annotations

import os
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import blake3
import pytest

from epistemic_kvcache.server.process import ServerProcess
from helpers import small_tmpfs

TOKEN = "full-disk-token-0123456789abcdef"
BLOCK = 1 << 20


def content(key: str) -> bytes:
    return blake3.blake3(b"data:" + key.encode()).digest(length=BLOCK)


class Server(ServerProcess):
    """The server (durable, TOKEN, HTTP only, small tiers) on `persist_dir`, its output
    appended to `log`."""

    def __init__(self, persist_dir: Path, log: Path, cold: str) -> None:
        super().__init__(
            persist_dir,
            *("--hot-capacity-bytes", "8MiB", "--warm-capacity-bytes", "4MiB"),
            *("--cold-capacity-bytes", cold, "--log-level", "info"),
            backend="durable",
            token=TOKEN,
            resp=False,
            log_path=log,
            start_timeout_s=120,
        )

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(
            f"{self.url()}{path}",
            data=body,
            method=method,
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="needs root")
@pytest.mark.parametrize("cold", ["1GiB", "40MiB"], ids=["fs-is-the-limit", "cold-is-the-limit"])
def test_deleting_interleaved_keys_on_a_full_disk_lets_writes_in_again(
    tmp_path: Path, cold: str
) -> None:
    with small_tmpfs(tmp_path / "mnt", "64m") as mnt:
        srv = Server(mnt / "store", tmp_path / "server.log", cold)
        try:
            stored: list[str] = []
            for i in range(200):  # fill until the disk (or the cold tier) says no
                key = f"k{i:03d}"
                status, _ = srv.call("PUT", f"/kv/{key}", content(key))
                if status != 200 and status != 201 and status != 204:
                    assert status == 507, status
                    break
                stored.append(key)
            if cold == "1GiB":
                assert srv.call("GET", "/readyz")[0] == 503  # full: not ready
            assert len(stored) >= 20
            # the cold tier evicts (it never says no): stop at the capacity instead
            kept = [k for k in stored if srv.call("GET", f"/kv/{k}")[0] == 200]
            deleted = kept[::2]
            for key in deleted:
                assert srv.call("DELETE", f"/kv/{key}")[0] in (200, 204)
            survivors = [k for k in kept if k not in set(deleted)]
            # the freed half must take new writes, without a restart
            deadline = time.monotonic() + 30
            new: list[str] = []
            while time.monotonic() < deadline and len(new) < len(deleted) // 2:
                key = f"n{len(new):03d}"
                status, _ = srv.call("PUT", f"/kv/{key}", content(key))
                if status in (200, 201, 204):
                    new.append(key)
                else:
                    assert status == 507, status
                    time.sleep(0.2)  # polling a deadline: space comes back asynchronously
            assert len(new) >= len(deleted) // 2, (len(new), len(deleted))
            while time.monotonic() < deadline and srv.call("GET", "/readyz")[0] != 200:
                time.sleep(0.2)
            assert srv.call("GET", "/readyz")[0] == 200
            for key in survivors + new:
                status, body = srv.call("GET", f"/kv/{key}")
                assert status == 200, key
                assert body == content(key), key
        finally:
            srv.kill()

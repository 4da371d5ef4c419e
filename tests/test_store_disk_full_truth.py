"""Disk full is one truth: the write refused, `/readyz`, the gauges, the stats agree.

A real server process (`python -m epistemic_kvcache serve`, durable backend) on a real
12 MiB tmpfs takes 1 MB PUTs until one is refused (507). Before, that refusal left
`/readyz` at 200 with `"disk_full": false`, `kvcache_store_disk_full` 0 and
`kvcache_store_writable` 1 (a health check cleared the flag again as soon as a
sixteenth of the file system, 768 KiB, was free; the PUT had needed 1.25 MB), and they
flipped only at ~330 KB free. Now the first refusal flips all of them at once, and a
DELETE that makes room flips them back (`store/freespace.py`). The file system's own
free space is exported (`kvcache_store_fs_free_bytes`, `kvcache_store_fs_total_bytes`)
for the nearly-full alert, whatever `--cold-capacity-bytes` says.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
from pathlib import Path

import blake3
import pytest

from helpers import eventually, small_tmpfs
from servers import TOKEN, ServeProcess

BLOCK = 1_000_000
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mount") is None,
    reason="mounts a real 12 MiB tmpfs: needs root and mount(8)",
)


def content(key: str) -> bytes:
    return blake3.blake3(key.encode()).digest(length=BLOCK)


class Probe:
    """HTTP calls to one server, and every signal an operator reads about the disk."""

    def __init__(self, srv: ServeProcess) -> None:
        self.port = srv.http_port

    def call(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            conn.request(method, path, body=body, headers={"Authorization": f"Bearer {TOKEN}"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def signals(self) -> dict[str, object]:
        """`/readyz`, the gauges, `/kv/stats`: what each says about the disk."""
        status, body = self.call("GET", "/readyz")
        ready = json.loads(body)
        _, metrics = self.call("GET", "/metrics")
        text = metrics.decode()

        def gauge(name: str) -> float:
            m = re.search(rf"^{name} (\S+)$", text, re.M)
            assert m is not None, name
            return float(m.group(1))

        return {
            "readyz": status,
            "readyz_disk_full": ready["disk_full"],
            "readyz_writable": ready["writable"],
            "gauge_disk_full": gauge("kvcache_store_disk_full"),
            "gauge_writable": gauge("kvcache_store_writable"),
            "gauge_ready": gauge("kvcache_store_ready"),
        }

    def fs(self) -> tuple[float, float]:
        _, metrics = self.call("GET", "/metrics")
        text = metrics.decode()
        free = re.search(r"^kvcache_store_fs_free_bytes (\S+)$", text, re.M)
        total = re.search(r"^kvcache_store_fs_total_bytes (\S+)$", text, re.M)
        assert free is not None, "kvcache_store_fs_free_bytes not exported"
        assert total is not None, "kvcache_store_fs_total_bytes not exported"
        return float(free.group(1)), float(total.group(1))


FULL = {
    "readyz": 503,
    "readyz_disk_full": True,
    "readyz_writable": False,
    "gauge_disk_full": 1.0,
    "gauge_writable": 0.0,
    "gauge_ready": 0.0,
}
NOT_FULL = {
    "readyz": 200,
    "readyz_disk_full": False,
    "readyz_writable": True,
    "gauge_disk_full": 0.0,
    "gauge_writable": 1.0,
    "gauge_ready": 1.0,
}


@needs_root
def test_the_first_refused_write_flips_every_signal_and_a_delete_flips_them_back(
    tmp_path: Path,
) -> None:
    with small_tmpfs(tmp_path / "mnt", "12m") as mnt:
        srv = ServeProcess(mnt / "store", backend="durable", resp=False)
        try:
            probe = Probe(srv)
            assert probe.signals() == NOT_FULL
            stored: list[str] = []
            refused = ""
            for i in range(20):
                key = f"k{i}"
                status, _ = probe.call("PUT", f"/kv/{key}", content(key))
                if status == 507:
                    refused = key
                    break
                assert status == 201, status
                stored.append(key)
                # as long as writes are taken, nobody says the disk is full
                assert probe.signals() == NOT_FULL, (key, probe.signals())
            assert refused, "12 MiB should not hold 20 MB"
            assert len(stored) >= 8
            # the refusal itself flips every signal, with space still free on the disk
            assert probe.signals() == FULL
            st = os.statvfs(mnt)
            assert st.f_bavail * st.f_frsize > 256 << 10  # not the last byte: it needed more
            assert probe.call("PUT", f"/kv/{refused}", content(refused))[0] == 507
            assert probe.signals() == FULL  # and it stays so while writes are refused
            # a DELETE that makes room flips them all back
            assert probe.call("DELETE", f"/kv/{stored[0]}")[0] == 204
            eventually(lambda: probe.signals() == NOT_FULL, what="not full after a DELETE")
            assert probe.call("PUT", f"/kv/{refused}", content(refused))[0] == 201
            for key in [*stored[1:], refused]:
                assert probe.call("GET", f"/kv/{key}") == (200, content(key)), key
            # the file system's own space, for the nearly-full alert
            free, total = probe.fs()
            assert total == 12 << 20
            st = os.statvfs(mnt)
            assert abs(free - st.f_bavail * st.f_frsize) <= 1 << 20
        finally:
            srv.stop()

"""Build deploy/docker/Dockerfile with a daemonless builder and start the server in it.

There is no container engine on the CI machines, so: a Debian 12 root made locally with
`debootstrap` becomes the base image (`podman import`), `buildah bud` builds the
Dockerfile (chroot isolation, vfs storage), and `buildah run` starts
`epistemic-kvcache serve` from the built image's file system as the image's user.
(`podman run` cannot start it here: crun's setrlimit calls are refused in this sandbox.)
The test checks what a user of the image relies on: it builds, runs as uid 10001, reads
its tokens from the secret file, serves a PUT/GET, and its HEALTHCHECK command passes.

Needs root, buildah, podman and debootstrap (`make sysdeps` installs them) and network
access to the Debian mirror and PyPI: ~2 minutes for the root, ~2 for the build.
Set KVCACHE_IMAGE_ROOTFS to reuse a bootstrapped root between runs.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from helpers import held_port

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("buildah", "podman", "debootstrap")
STORAGE = ROOT / "build" / "image-storage"
STORE = (
    "--root", str(STORAGE / "root"), "--runroot", str(STORAGE / "run"), "--storage-driver", "vfs",
)  # fmt: skip
"""Our own container storage, always vfs: the machine's default store may have been made
by another driver (installing podman made an overlay one here, and podman then refused
`--storage-driver vfs` on it: "database configuration mismatch")."""
BASE = "localhost/epistemic-kvcache-base:bookworm"
IMAGE = "localhost/epistemic-kvcache:test"
TOKEN = "imagetesttoken-0123456789abcdef0123"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.image,
    pytest.mark.skipif(
        any(shutil.which(t) is None for t in TOOLS) or os.geteuid() != 0,
        reason="needs root and buildah, podman, debootstrap (make sysdeps)",
    ),
    pytest.mark.timeout(1500),
]


def run(*cmd: str, timeout: float = 900) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def base_image(tmp: Path) -> None:
    if subprocess.run(["podman", *STORE, "image", "exists", BASE], check=False).returncode == 0:
        return
    rootfs = Path(os.environ.get("KVCACHE_IMAGE_ROOTFS") or tmp / "rootfs")
    if not (rootfs / "usr" / "bin" / "python3").exists():
        run(
            "debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
            "bookworm", str(rootfs), "http://deb.debian.org/debian",
        )  # fmt: skip
    with subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE) as tar:
        imp = subprocess.run(
            ["podman", *STORE, "import", "-", BASE],
            stdin=tar.stdout,
            capture_output=True,
            check=False,
        )
    assert imp.returncode == 0, imp.stderr


def test_image_builds_and_serves(tmp_path: Path) -> None:
    base_image(tmp_path)
    build = ["buildah", *STORE, "bud", "--isolation", "chroot", "--format", "docker"]
    ca = Path("/etc/ssl/certs/ca-certificates.crt")  # for a TLS-intercepting proxy
    if ca.exists():
        build += ["--secret", f"id=pip-ca,src={ca}"]
    run(
        *build, "-f", "deploy/docker/Dockerfile", "--build-arg", f"BASE={BASE}", "-t", IMAGE,
        str(ROOT),
    )  # fmt: skip
    inspect = run("buildah", *STORE, "inspect", "--type", "image", IMAGE)
    assert '"User": "10001:10001"' in inspect
    assert '"healthcheck"' in inspect

    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} default\n")
    tokens.chmod(0o644)  # read by uid 10001 in the image
    port = held_port()  # held for the rest of the run: nobody else takes it meanwhile
    ctr = run("buildah", *STORE, "from", IMAGE).strip()
    env = [
        "--env", f"EPISTEMIC_GRAPH_KVCACHE_ADDR=127.0.0.1:{port}",
        "--env", "EPISTEMIC_GRAPH_KVCACHE_RESP_ADDR=off",
    ]  # fmt: skip
    common = ["buildah", *STORE, "run", "--isolation", "chroot", "--network", "host", *env]
    log = (tmp_path / "serve.log").open("wb")
    secret = ["-v", f"{tokens}:/run/secrets/kvcache-tokens:ro"]
    server = subprocess.Popen(
        [*common, *secret, ctr, "--", "epistemic-kvcache", "serve"],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.5)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        put = urllib.request.Request(url + "/kv/img", data=b"kv" * 1000, method="PUT", headers=auth)
        with urllib.request.urlopen(put, timeout=10) as r:
            assert r.status == 201
        with urllib.request.urlopen(urllib.request.Request(url + "/kv/img", headers=auth)) as r:
            assert r.read() == b"kv" * 1000
        inside = run(*common, ctr, "--", "sh", "-c", "id -u; epistemic-kvcache healthcheck")
        assert inside.split() == ["10001"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        log.close()
        subprocess.run(["buildah", *STORE, "rm", ctr], capture_output=True, check=False)
    assert "listening http=127.0.0.1:" in (tmp_path / "serve.log").read_text()

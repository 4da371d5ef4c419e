"""Real processes for the vLLM end-to-end tests: our server, `lmcache server`, vLLM.

Nothing here stands in for anything: each helper starts the real program from the e2e
virtualenv (`sys.executable`'s folder) and waits for it by polling with a deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: the main suite's helpers

from helpers import held_port  # noqa: E402

ROOT = HERE.parent.parent
DEPLOY = ROOT / "deploy" / "lmcache"
BIN = Path(sys.executable).parent
RESULTS = ROOT / "build" / "e2e-results.jsonl"
LISTEN_RE = re.compile(r"listening (http|resp)=(\S+):(\d+)")

# Two tenants (tokens from a --token-file); the second must never see the first's entries.
TOKEN_A = "e2e-tenant-a-token-0123456789abcdef"
TOKEN_B = "e2e-tenant-b-token-0123456789abcdef"

# Every server process started here, so a failed test still stops them (conftest.py).
LIVE: list[Any] = []

# A lean vLLM on a small shared CPU: one OpenMP thread, no thread pinning.
VLLM_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "LMCACHE_TRACK_USAGE": "false",
    "LMCACHE_DISABLE_BANNER": "1",
    "PYTHONWARNINGS": "ignore",
}


def clean_env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("EPISTEMIC_GRAPH_")}
    return {**base, **VLLM_ENV, **extra}


def wait_until(what: str, ok: Any, timeout_s: float, proc: subprocess.Popen[Any] | None = None,
               log: Path | None = None) -> Any:  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        got = ok()
        if got:
            return got
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log else ""
            raise RuntimeError(f"{what}: process exited with {proc.returncode}\n{tail}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not ready after {timeout_s} s")
        time.sleep(0.5)


class KvServer:
    """`epistemic-kvcache serve`, durable backend, two tenants, on fresh loopback ports."""

    def __init__(self, data: Path) -> None:
        self.data = data
        data.mkdir(parents=True, exist_ok=True)
        tokens = data.parent / "tokens"
        tokens.write_text(f"{TOKEN_A} tenant-a\n{TOKEN_B} tenant-b\n")
        tokens.chmod(0o600)
        self.log = data.parent / f"kvserver-{time.monotonic_ns()}.log"
        cmd = [str(BIN / "epistemic-kvcache"), "serve", "--addr", "127.0.0.1:0",
               "--resp-addr", "127.0.0.1:0", "--backend", "durable",
               "--persist-dir", str(data), "--token-file", str(tokens)]  # fmt: skip
        self.proc = subprocess.Popen(
            cmd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.ports: dict[str, int] = {}
        ready = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            with self.log.open("w") as out:
                for line in self.proc.stdout:
                    out.write(line)
                    out.flush()
                    m = LISTEN_RE.search(line)
                    if m:
                        self.ports[m.group(1)] = int(m.group(3))
                        if len(self.ports) == 2:
                            ready.set()
            ready.set()

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        LIVE.append(self)
        if not ready.wait(60) or len(self.ports) != 2:
            self.stop()
            raise RuntimeError("server did not start:\n" + self.log.read_text())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    @property
    def resp_port(self) -> int:
        return self.ports["resp"]

    def stats(self, token: str = TOKEN_A) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self.url}/kv/stats", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            doc: dict[str, Any] = json.loads(resp.read())
        return doc

    def kill(self) -> None:
        """SIGKILL: nothing is flushed or closed on the way out."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._close()

    def _close(self) -> None:
        self._pump.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def wait_stored(kv: KvServer, keys: int, timeout_s: float = 60.0) -> None:
    """Until the tenant holds `keys` keys: LMCache writes to L2 behind the request."""
    wait_until(f"{keys} keys stored", lambda: kv.stats()["total_refs"] >= keys, timeout_s)


def l2_adapter(kind: str, kv: KvServer) -> str:
    """The shipped deploy/lmcache/ JSON for `kind` with this server's address filled in."""
    if kind == "native":
        spec = json.loads((DEPLOY / "mp-native-plugin.json").read_text())
        spec["adapter_params"]["base_url"] = kv.url
    else:
        spec = json.loads((DEPLOY / "mp-resp.json").read_text())
        spec["port"] = kv.resp_port
    return json.dumps(spec)


class LMCacheServer:
    """`lmcache server` (MP mode) with one of our L2 adapters, engine-driven transfers."""

    def __init__(self, tmp: Path, kind: str, kv: KvServer, token: str = TOKEN_A) -> None:
        # held for the rest of the run (LMCache's zmq and uvicorn bind with SO_REUSEADDR):
        # a port released before the server binds it could be taken by another process
        self.port = held_port()
        self.http_port = held_port()
        self.log = tmp / f"lmcache-{kind}-{self.port}.log"
        cmd = [str(BIN / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
               "--l1-size-gb", "0.2", "--eviction-policy", "LRU",
               "--supported-transfer-mode", "engine_driven", "--max-workers", "1",
               "--l2-adapter", l2_adapter(kind, kv), "--disable-observability"]  # fmt: skip
        env = clean_env(EPISTEMIC_GRAPH_KVCACHE_TOKEN=token, LMCACHE_RESP_PASSWORD=token)
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        LIVE.append(self)
        wait_until("lmcache server", self._up, 300, self.proc, self.log)

    def _up(self) -> bool:
        try:
            url = f"http://127.0.0.1:{self.http_port}/config/adapters"
            with urllib.request.urlopen(url, timeout=5) as resp:
                return resp.status == 200
        except OSError:
            return False

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def generate(tmp: Path, name: str, model: Path, *args: str, **env: str) -> dict[str, Any]:
    """tests/e2e/generate.py in a fresh process; its JSON result. It must exit 0."""
    out = tmp / f"{name}.json"
    log = tmp / f"{name}.log"
    cmd = [sys.executable, str(HERE / "generate.py"), "--model", str(model), "--out", str(out),
           *args]  # fmt: skip
    with log.open("w") as f:
        done = subprocess.run(cmd, env=clean_env(**env), stdout=f, stderr=subprocess.STDOUT,
                              timeout=900, check=False)  # fmt: skip
    text = log.read_text(errors="replace")
    assert done.returncode == 0, f"{name}: exit {done.returncode}\n{text[-6000:]}"
    assert "Traceback" not in text, f"{name}: a traceback in vLLM's output\n{text[-6000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    result["log"] = str(log)
    # Every process's figures, for docs/does-it-pay.md (build/ is not committed).
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    stamp = {"ts_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "load_average": list(os.getloadavg())}  # fmt: skip
    with RESULTS.open("a") as f:
        f.write(json.dumps({"name": name, **result, **stamp}) + "\n")
    print(f"{name}: " + json.dumps({k: v for k, v in result.items() if k != "output_token_ids"}))
    return result

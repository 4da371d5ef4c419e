"""Real processes for the vLLM end-to-end tests: our server, `lmcache server`, vLLM.

Nothing here stands in for anything: each helper starts the real program from the e2e
virtualenv (`sys.executable`'s folder) and waits for it by polling with a deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import redis

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # tests/: the main suite's helpers

from helpers import held_port  # noqa: E402

ROOT = HERE.parent.parent
DEPLOY = ROOT / "deploy" / "lmcache"
BIN = Path(sys.executable).parent
RESULTS = ROOT / "build" / "e2e-results.jsonl"

# Two tenants (tokens from a --token-file); the second must never see the first's entries.
TOKEN_A = "e2e-tenant-a-token-0123456789abcdef"
TOKEN_B = "e2e-tenant-b-token-0123456789abcdef"

# Every process started here, so a failed test still stops them (conftest.py).
LIVE: list[Any] = []

# A lean vLLM on a small shared CPU: one OpenMP thread, no thread pinning, and its engine
# in the test's vLLM process (vLLM's multiprocess engine imports vLLM twice more, in its
# EngineCore and worker processes: about 30 s more per process here). The connectors,
# LMCache and this server run the same code either way; E2E_VLLM_MULTIPROCESSING=1 runs
# every vLLM with its multiprocess engine.
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
    # vLLM imports tests/e2e/cpu_connector.py by module name; the caller's path is kept
    "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    "VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("E2E_VLLM_MULTIPROCESSING", "0"),
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
        time.sleep(0.2)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


class KvServer:
    """`epistemic-kvcache serve`, durable backend, two tenants, on held loopback ports.

    The ports are held for the whole run (helpers.held_port), so `restart()` brings the
    server back on the same address and data, as an operator's restart does.
    """

    def __init__(self, data: Path, ports: tuple[int, int] | None = None) -> None:
        self.data = data
        data.mkdir(parents=True, exist_ok=True)
        tokens = data.parent / "tokens"
        tokens.write_text(f"{TOKEN_A} tenant-a\n{TOKEN_B} tenant-b\n")
        tokens.chmod(0o600)
        self.http_port, self.resp_port = ports or (held_port(), held_port())
        self.log = data.parent / f"kvserver-{time.monotonic_ns()}.log"
        cmd = [str(BIN / "epistemic-kvcache"), "serve", "--addr", f"127.0.0.1:{self.http_port}",
               "--resp-addr", f"127.0.0.1:{self.resp_port}", "--backend", "durable",
               "--persist-dir", str(data), "--token-file", str(tokens)]  # fmt: skip
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, env=clean_env(), stdout=out, stderr=subprocess.STDOUT)
        LIVE.append(self)
        wait_until("our server", self._listening, 60, self.proc, self.log)

    def _listening(self) -> bool:
        text = self.log.read_text(errors="replace")
        return "listening http=" in text and "listening resp=" in text

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def stats(self, token: str = TOKEN_A) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{self.url}/kv/stats", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            doc: dict[str, Any] = json.loads(resp.read())
        return doc

    def resp(self, token: str = TOKEN_A) -> redis.Redis:
        """A redis-py client of the tenant's namespace (RESP, the tenant's token)."""
        return redis.Redis(host="127.0.0.1", port=self.resp_port, password=token)

    def keys(self, token: str = TOKEN_A) -> set[str]:
        """Every key of the tenant's namespace (RESP `SCAN`)."""
        with self.resp(token) as r:
            return {k.decode() for k in r.scan_iter(count=1000)}

    def kill(self) -> None:
        """SIGKILL: nothing is flushed or closed on the way out."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def restart(self) -> KvServer:
        """SIGKILL, then a new server process on the same ports and data."""
        self.kill()
        return KvServer(self.data, (self.http_port, self.resp_port))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def wait_stored(kv: KvServer, keys: int, token: str = TOKEN_A, timeout_s: float = 60.0) -> None:
    """Until the tenant holds `keys` keys: LMCache writes to L2 behind the request."""
    wait_until(f"{keys} keys stored", lambda: kv.stats(token)["total_refs"] >= keys, timeout_s)


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
    """`lmcache server` (MP mode) with one of our L2 adapters.

    Dense models: engine-driven transfers (the worker hands LMCache the bytes), stock
    `lmcache`. Hybrid models (`hybrid=True`): server-driven transfers over shared memory,
    which LMCache needs for more than one KV group, with 256-token chunks and, if asked,
    one object group per kind of layer; run through tests/e2e/lmcache_cpu_mp.py, which
    patches LMCache's CPU code for it (see there).
    """

    def __init__(self, tmp: Path, kind: str, kv: KvServer, token: str = TOKEN_A, *,
                 hybrid: bool = False, separate_groups: bool = False) -> None:  # fmt: skip
        # held for the rest of the run (LMCache's zmq and uvicorn bind with SO_REUSEADDR):
        # a port released before the server binds it could be taken by another process
        self.port = held_port()
        self.http_port = held_port()
        self.log = tmp / f"lmcache-{kind}-{self.port}.log"
        run = [str(BIN / "lmcache")]
        mode = ["--supported-transfer-mode", "engine_driven"]
        if hybrid:
            run = [sys.executable, str(HERE / "lmcache_cpu_mp.py")]
            mode = ["--supported-transfer-mode", "lmcache_driven", "--chunk-size", "256"]
            if separate_groups:
                mode.append("--separate-object-groups")
        cmd = [*run, "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--http-host", "127.0.0.1", "--http-port", str(self.http_port),
               "--l1-size-gb", "0.2", "--eviction-policy", "LRU", *mode, "--max-workers", "1",
               "--l2-adapter", l2_adapter(kind, kv), "--disable-observability"]  # fmt: skip
        env = clean_env(EPISTEMIC_GRAPH_KVCACHE_TOKEN=token, LMCACHE_RESP_PASSWORD=token)
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        LIVE.append(self)

    def wait_up(self) -> None:
        """Until its HTTP port answers (the constructor does not wait)."""
        url = f"http://127.0.0.1:{self.http_port}/config/adapters"
        wait_until("lmcache server", lambda: _http_ok(url), 300, self.proc, self.log)

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


class Vllm:
    """tests/e2e/generate.py: one vLLM process, started now, its engine built by `start`.

    Starting the process early lets its import (most of its cost) overlap the test's other
    work; the engine is built only when `start` is called.
    """

    def __init__(self, tmp: Path, name: str, model: Path, *, hybrid: bool = False,
                 **env: str) -> None:  # fmt: skip
        self.name = name
        self.out = tmp / f"{name}.jsonl"
        self.log = tmp / f"{name}.log"
        self.answers = 0
        cmd = [sys.executable, str(HERE / "generate.py"), "--model", str(model),
               "--out", str(self.out)] + (["--hybrid"] if hybrid else [])  # fmt: skip
        with self.log.open("w") as f:
            self.proc = subprocess.Popen(cmd, env=clean_env(**env), stdin=subprocess.PIPE,
                                         stdout=f, stderr=subprocess.STDOUT, text=True)  # fmt: skip
        LIVE.append(self)

    def _ask(self, cmd: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        self.answers += 1

        def answered() -> list[str] | None:
            lines = self.out.read_text().splitlines() if self.out.exists() else []
            return lines if len(lines) >= self.answers else None

        lines = wait_until(f"{self.name}: {cmd['op']}", answered, timeout_s, self.proc, self.log)
        answer: dict[str, Any] = json.loads(lines[self.answers - 1])
        return answer

    def start(self, connector: str = "plain", mp_port: int | None = None,
              **env: str) -> None:  # fmt: skip
        self._ask({"op": "start", "connector": connector, "mp_port": mp_port, "env": env})

    def generate(self, prompt: str, record: str | None = None) -> dict[str, Any]:
        """One greedy generation; kept in build/e2e-results.jsonl under `record`."""
        result = self._ask({"op": "generate", "prompt": prompt})
        result["log"] = str(self.log)
        # Every generation's figures, for docs/does-it-pay.md (build/ is not committed).
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with RESULTS.open("a") as f:
            stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            doc = {"name": record or f"{self.name}-{prompt}", "ts_utc": stamp,
                   "load_average": list(os.getloadavg()), **result}  # fmt: skip
            f.write(json.dumps(doc) + "\n")
        shown = {k: v for k, v in result.items() if k not in ("output_token_ids", "log")}
        print(f"{self.name} {prompt}: {json.dumps(shown)}")
        return result

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def close(self) -> None:
        """Stop the engine and the process; it must exit 0 with no traceback."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.close()
        try:
            rc = self.proc.wait(300)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGUSR1)  # generate.py dumps every thread's stack
            time.sleep(2)  # for the dump to reach the log; the process is killed next
            raise AssertionError(
                f"{self.name}: still running 300 s after quit\n{self.text()[-8000:]}"
            ) from None
        text = self.text()
        assert rc == 0, f"{self.name}: exit {rc}\n{text[-6000:]}"
        assert "Traceback" not in text, f"{self.name}: a traceback in vLLM's output\n{text[-6000:]}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):  # unread commands: of no use now
                self.proc.stdin.close()

"""Run in a venv holding only `pip install epistemic-kvcache` (no extras): the client
imports without the store or server dependencies, fast; `serve` names the missing extra.

Prints the installed distributions and the import time (best of 5 fresh interpreters).
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

HEAVY = ("lmdb", "blosc2", "numpy", "uvloop", "httptools", "prometheus_client", "jwt")


def main() -> int:
    dists = sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions())
    print("installed:", " ".join(dists))
    for name in HEAVY:
        if name in {d.split("==")[0].lower().replace("-", "_") for d in dists}:
            print(f"FAIL: {name} is installed with the client alone")
            return 1
    code = (
        "import sys, time, json; t = time.perf_counter(); import epistemic_kvcache.client;"
        "print(json.dumps([time.perf_counter() - t, sorted(sys.modules)]))"
    )
    times = []
    for _ in range(5):
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        seconds, modules = json.loads(out.stdout)
        times.append(seconds)
        bad = [m for m in modules if m.split(".")[0] in HEAVY or ".store" in m or ".server" in m]
        if bad:
            print("FAIL: the client imported", bad)
            return 1
    print(f"import epistemic_kvcache.client: best {min(times) * 1000:.0f} ms of 5")
    proc = subprocess.run(
        [sys.executable, "-m", "epistemic_kvcache", "serve", "--token", "t" * 32],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode == 0 or "pip install 'epistemic-kvcache[server] @ git+" not in proc.stderr:
        print("FAIL: serve without the server extra:", proc.returncode, proc.stderr)
        return 1
    print("serve without [server]:", proc.stderr.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())

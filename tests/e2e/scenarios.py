"""The scenarios every LMCache path goes through, with vLLM driving LMCache into our server.

One test per path (`run_path`), sharing its processes between the scenarios:

1. **P1** (tenant A, a fresh vLLM; in MP mode a fresh `lmcache server`) computes prompts
   x, y and z and stores their chunks; SCAN tells which keys each prompt wrote.
2. **restart**: our server is SIGKILLed and started again on the same data; every key P1
   wrote is still there.
3. **negative control**: y's stored KV bytes are overwritten in our server with zeros of
   the same size (RESP `SET`, tenant A's token).
4. **P2** (tenant A, a fresh vLLM and `lmcache server`): x loads from our server (vLLM
   counts 768 cached tokens, LMCache logs the retrieval, our GET hits rise by the chunks'
   keys) and the output equals P1's; y loads the zeroed bytes just as well (768 cached,
   GET hits rise) and the output differs from P1's, so an identical output is evidence
   that the loaded bytes were used.
5. **second tenant**: a fresh vLLM whose LMCache has tenant B's token computes x: no
   cached tokens, no retrieval, no GET hits in B's namespace, P1's output; and B's own
   writes reach the server (B's namespace then holds x's keys under the same names as
   A's, A's keys untouched).
6. **server down**: our server is SIGKILLed under P2; z, which our server holds but
   cannot serve, is recomputed (0 cached, P1's output) within a bound, and the path's
   failure handling shows in its log.

Each vLLM process (and `lmcache server`) is started before its step, so its start-up
overlaps the steps before it; its engine is built only at its step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from harness import (
    DEPLOY,
    TOKEN_A,
    TOKEN_B,
    KvServer,
    LMCacheServer,
    Vllm,
    wait_until,
)

CHUNK = 256
REUSABLE = 768  # three full 256-token chunks of a ~900-token prompt: LMCache's reuse
# With our server SIGKILLed, the time to first token must stay within this (every path
# fails its lookup at once; measured TTFTs in docs/lmcache.md, "vLLM end to end").
DOWN_TTFT_BOUND_S = 5.0


@dataclass(frozen=True)
class LMCachePath:
    """How one LMCache path is set up, and what it leaves in logs and in our server."""

    name: str
    down_log: str  # in its log once our server is down: the failure path ran
    mp: str | None = None  # the MP L2 adapter ("native", "resp"); None: v1 mode
    config: str | None = None  # v1: the shipped deploy/lmcache/ YAML
    keys_per_prompt: int = 3  # keys one ~900-token prompt writes
    gets_per_load: int = 3  # our GET hits when a prompt's 768 tokens load
    victim_suffix: str = ""  # the keys holding KV bytes (redis://: "kv_bytes")

    def victims(self, keys: set[str]) -> set[str]:
        return {k for k in keys if k.endswith(self.victim_suffix)}


PATHS = {
    p.name: p
    for p in [
        # Our plugin: a refused connection opens its circuit breaker (one log line), every
        # lookup is a miss at once.
        LMCachePath("native", "server not answering", mp="native"),
        # LMCache's C++ RESP client: a lookup on a dead connection is a silent miss; the
        # store that follows fails and LMCache logs it.
        LMCachePath("resp", "to adapter 0 failed", mp="resp"),
        LMCachePath("path-a", "server not answering", config="path-a-storage-plugin.yaml"),
        # redis-py stores two keys per chunk (`kv_bytes`, `metadata`); a refused
        # connection fails LMCache's `contains`, which answers False.
        LMCachePath(
            "redis-url",
            "Remote connection failed in contains",
            config="path-b-remote-url.yaml",
            keys_per_prompt=6,
            gets_per_load=6,
            victim_suffix="kv_bytes",
        ),
        # LMCache's C++ RESP client: the lookup's error on a dead connection comes back at
        # once (with tests/e2e/lmcache_client_race.py's fix in; without it the error can
        # be lost and the lookup wait for good).
        LMCachePath(
            "resp-url",
            "Remote connection failed in batched_contains",
            config="path-b-resp-url.yaml",
        ),
    ]
}


def v1_config(tmp: Path, name: str, kv: KvServer) -> Path:
    """The shipped YAML with only the server's address changed and LMCache's RAM shrunk."""
    doc = yaml.safe_load((DEPLOY / name).read_text())
    doc["max_local_cpu_size"] = 0.2
    if "remote_url" in doc and doc["remote_url"].startswith("resp://"):
        doc["remote_url"] = f"resp://127.0.0.1:{kv.resp_port}"
    extra = doc.get("extra_config") or {}
    if "storage_plugin.epistemic_graph.base_url" in extra:
        extra["storage_plugin.epistemic_graph.base_url"] = kv.url
    out = tmp / name
    out.write_text(yaml.safe_dump(doc))
    return out


class Client:
    """One LMCache client of our server: a fresh vLLM process (importing from now on) and,
    in MP mode, its own fresh `lmcache server` (from `prepare` or `start`: its L1 empty).
    `hybrid`: the hybrid model's settings (MP only; `separate`: one object per group)."""

    def __init__(self, tmp: Path, path: LMCachePath, model: Path, name: str, kv: KvServer,
                 token: str = TOKEN_A, *, hybrid: bool = False, separate: bool = False
                 ) -> None:  # fmt: skip
        self.tmp, self.path, self.token, self.name = tmp, path, token, name
        self.hybrid, self.separate = hybrid, separate
        self.lmc: LMCacheServer | None = None
        env: dict[str, str] = {}
        if path.config is not None:
            env = {
                "LMCACHE_CONFIG_FILE": str(v1_config(tmp, path.config, kv)),
                "EPISTEMIC_GRAPH_KVCACHE_TOKEN": token,
                "LMCACHE_RESP_PASSWORD": token,
            }
            if path.name == "redis-url":
                env["LMCACHE_REMOTE_URL"] = f"redis://:{token}@127.0.0.1:{kv.resp_port}"
        elif hybrid:
            env = {"LMCACHE_MP_TRANSFER_MODE": "lmcache_driven"}
        self.vllm = Vllm(tmp, name, model, hybrid=hybrid, **env)

    def prepare(self, kv: KvServer) -> None:
        """MP mode: start the `lmcache server` now (our server must be up)."""
        if self.path.mp is not None and self.lmc is None:
            self.lmc = LMCacheServer(self.tmp, self.path.mp, kv, self.token,
                                     hybrid=self.hybrid, separate_groups=self.separate)  # fmt: skip

    def start(self, kv: KvServer) -> None:
        """Build vLLM's engine (in MP mode once its `lmcache server` answers)."""
        self.prepare(kv)
        if self.lmc is None:
            self.vllm.start("v1")
            return
        self.lmc.wait_up()
        self.vllm.start("mp-cpu" if self.hybrid else "mp", self.lmc.port)

    def log(self) -> str:
        """Where LMCache logs: `lmcache server` in MP mode, vLLM's process in v1 mode."""
        return self.lmc.text() if self.lmc is not None else self.vllm.text()

    def close(self) -> None:
        self.vllm.close()
        if self.lmc is not None:
            self.lmc.stop()


def l2_retrieved(log: str) -> int:
    """What LMCache says it retrieved: MP, chunks its prefetch found in L2 (`(... L1, N
    L2)`); v1, tokens (`Retrieved N out of ...`)."""
    mp = sum(int(m) for m in re.findall(r"retained keys \(\d+ L1, (\d+) L2\)", log))
    return mp + sum(int(m) for m in re.findall(r"Retrieved (\d+) out of", log))


def expect_retrieved(path: LMCachePath) -> int:
    return 3 if path.mp else REUSABLE


def load(client: Client, kv: KvServer, prompt: str, record: str) -> dict[str, Any]:
    """`prompt` through `client`, which must load its 768 tokens from our server."""
    before, mark = kv.stats(client.token), len(client.log())
    result = client.vllm.generate(prompt, record)
    after = kv.stats(client.token)
    assert result["num_cached_tokens"] == REUSABLE, result
    assert after["get_hits"] - before["get_hits"] == client.path.gets_per_load, (before, after)
    log = client.log()[mark:]
    assert l2_retrieved(log) >= expect_retrieved(client.path), log[-3000:]
    return result


def store(client: Client, kv: KvServer, prompt: str, known: set[str], record: str
          ) -> tuple[dict[str, Any], set[str]]:  # fmt: skip
    """`prompt` through `client` with nothing to load; the keys its chunks were stored as."""
    result = client.vllm.generate(prompt, record)
    assert result["num_cached_tokens"] == 0, result
    assert CHUNK * 3 < result["prompt_tokens"] < 1024 - 16, result
    want = len(known) + client.path.keys_per_prompt
    wait_until(f"{client.name}: {prompt} stored", lambda: len(kv.keys(client.token)) >= want, 60)
    keys = kv.keys(client.token)
    assert len(keys) == want, (want, sorted(keys - known))
    return result, keys - known


def corrupt(kv: KvServer, keys: set[str]) -> None:
    """Overwrite each key's bytes with as many zeros (RESP GET/SET, tenant A)."""
    assert keys
    with kv.resp(TOKEN_A) as r:
        for key in keys:
            value = r.get(key)
            assert value, key
            r.set(key, bytes(len(value)))


def run_path(tmp: Path, path: LMCachePath, model: Path, plain: dict[str, Any]) -> None:
    kv = KvServer(tmp / "kv")
    try:
        p1 = Client(tmp, path, model, f"{path.name}-p1", kv)
        p2 = Client(tmp, path, model, f"{path.name}-p2", kv)  # imports while P1 works
        p1.start(kv)
        x1, keys_x = store(p1, kv, "x", set(), f"{path.name}-p1")
        y1, keys_y = store(p1, kv, "y", keys_x, f"{path.name}-p1-y")
        z1, keys_z = store(p1, kv, "z", keys_x | keys_y, f"{path.name}-p1-z")
        p1.close()
        for prompt, result in {"x": x1, "y": y1, "z": z1}.items():
            assert result["output_token_ids"] == plain[prompt], prompt

        kv = kv.restart()  # SIGKILL, a new process on the same data and ports
        assert kv.keys() == keys_x | keys_y | keys_z
        corrupt(kv, path.victims(keys_y))

        p2.start(kv)
        tenant_b = Client(tmp, path, model, f"{path.name}-tenant-b", kv, TOKEN_B)
        tenant_b.prepare(kv)  # its `lmcache server` starts while P2 works
        x2 = load(p2, kv, "x", f"{path.name}-p2")
        assert x2["output_token_ids"] == x1["output_token_ids"]
        y2 = load(p2, kv, "y", f"{path.name}-p2-corrupt")
        assert y2["output_token_ids"] != y1["output_token_ids"], "a corrupted load went unseen"

        tenant_b.start(kv)
        mark = len(tenant_b.log())
        xb = tenant_b.vllm.generate("x", f"{path.name}-tenant-b")
        assert xb["num_cached_tokens"] == 0, xb
        assert xb["output_token_ids"] == x1["output_token_ids"]
        assert l2_retrieved(tenant_b.log()[mark:]) == 0
        assert kv.stats(TOKEN_B)["get_hits"] == 0
        # B's writes reached the server, in B's namespace, under the very names A's have.
        want = path.keys_per_prompt
        wait_until("tenant B's keys", lambda: len(kv.keys(TOKEN_B)) >= want, 60)
        assert kv.keys(TOKEN_B) == keys_x
        assert kv.keys(TOKEN_A) == keys_x | keys_y | keys_z
        tenant_b.close()

        kv.kill()  # under P2, whose LMCache has been talking to it
        mark = len(p2.log())
        z2 = p2.vllm.generate("z", f"{path.name}-server-down")
        assert z2["num_cached_tokens"] == 0, z2
        assert z2["output_token_ids"] == z1["output_token_ids"]
        assert z2["ttft_s"] < DOWN_TTFT_BOUND_S, z2
        wait_until(f"{p2.name}: {path.down_log!r}", lambda: path.down_log in p2.log()[mark:], 60)
        p2.close()
    finally:
        kv.stop()

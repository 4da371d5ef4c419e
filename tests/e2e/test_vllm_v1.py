"""vLLM -> LMCache v1 (in-process `LMCacheConnectorV1`) -> our server, end to end.

Each path runs the shipped deploy/lmcache/ YAML (only the server's address changed and
LMCache's local RAM tier shrunk for this machine). Process 1 generates greedily for a
900-token prompt and stores its chunks; process 2, a fresh vLLM with an empty LMCache,
generates for the same prompt. vLLM must report the reusable tokens as cached, LMCache
must log the retrieval, our `/kv/stats` `get_hits` must rise by the chunks retrieved and
the output tokens must equal process 1's and plain vLLM's.

The copy between vLLM's CPU KV cache and LMCache's buffers is the test-only
tests/e2e/cpu_connector.py (LMCache has no CPU connector; see its docstring).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness import DEPLOY, HERE, TOKEN_A, KvServer, generate, wait_stored

# Each vLLM process takes 30-150 s to build its `LLM()` on a shared 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

PROMPT_TOKENS = 900
CHUNK = 256


def v1_config(tmp: Path, name: str, kv: KvServer) -> Path:
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


def retrieved_tokens(log: str) -> int:
    """Tokens LMCache's v1 engine says it retrieved (`Retrieved N out of M ...`)."""
    return sum(int(m) for m in re.findall(r"Retrieved (\d+) out of", log))


@pytest.mark.parametrize(
    ("path", "config", "chunks", "cached"),
    [
        # vLLM hands LMCache the prompt's full 128-token blocks (896 tokens); LMCache
        # stores and finds its full 256-token chunks of them: 768 tokens.
        ("path-a", "path-a-storage-plugin.yaml", 3, 768),
        # redis-py stores two keys per chunk (`kv_bytes`, `metadata`).
        ("redis-url", "path-b-remote-url.yaml", 3, 768),
        ("resp-url", "path-b-resp-url.yaml", 3, 768),
    ],
)
def test_v1_path(
    tmp_path: Path,
    model: Path,
    plain: dict[str, Any],
    path: str,
    config: str,
    chunks: int,
    cached: int,
) -> None:
    kv = KvServer(tmp_path / "kv")
    try:
        cfg = v1_config(tmp_path, config, kv)
        env = {
            "LMCACHE_CONFIG_FILE": str(cfg),
            "PYTHONPATH": str(HERE),
            "EPISTEMIC_GRAPH_KVCACHE_TOKEN": TOKEN_A,
            "LMCACHE_RESP_PASSWORD": TOKEN_A,
            "LMCACHE_REMOTE_URL": f"redis://:{TOKEN_A}@127.0.0.1:{kv.resp_port}",
        }
        if path != "redis-url":
            del env["LMCACHE_REMOTE_URL"]
        p1 = generate(tmp_path, f"{path}-p1", model, "--v1", **env)
        assert p1["prompt_tokens"] == PROMPT_TOKENS
        assert p1["num_cached_tokens"] == 0
        assert p1["output_token_ids"] == plain["output_token_ids"]
        gets = chunks * (2 if path == "redis-url" else 1)
        wait_stored(kv, gets)
        before = kv.stats()
        p2 = generate(tmp_path, f"{path}-p2", model, "--v1", **env)
        after = kv.stats()
        assert p2["num_cached_tokens"] == cached, p2
        assert p2["output_token_ids"] == p1["output_token_ids"]
        assert after["get_hits"] - before["get_hits"] == gets, (before, after)
        assert retrieved_tokens(Path(p2["log"]).read_text()) >= cached
    finally:
        kv.stop()

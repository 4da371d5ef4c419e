"""A hybrid model (attention plus Gated DeltaNet recurrent layers) through LMCache MP.

The deployment's kind of model: tests/e2e/tiny_model.py's state-sensitive Qwen3-Next-
shaped model (3 GDN layers, 1 full-attention layer) with prefix caching in vLLM's
`mamba_cache_mode="align"`, the Mamba block, the batched-token budget and `lmcache server
--chunk-size` all 256 tokens. LMCache's MP connector is the only LMCache connector that
boots on such a model; it buckets the layers into object groups (the attention pages; an
opaque state page per block for the recurrent layers), either all in one object per chunk
or, with `--separate-object-groups`, one object per group per chunk. On a CPU it runs
through tests/e2e/lmcache_cpu_mp.py (LMCache's server-driven transfer, patched: see there).

Each test: process 1 (a fresh vLLM and `lmcache server`) computes prompts and stores their
chunks; process 2 (both fresh again, so every hit comes from our server) loads 768 tokens
of x from our server (vLLM's count, LMCache's log, our GET counter) with P1's output. With
separate groups, the negative control: y's recurrent-state objects are zeroed in our
server, and y's output changes although its 768 tokens load all the same.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from harness import TOKEN_A, KvServer, wait_stored, wait_until
from scenarios import PATHS, REUSABLE, Client, corrupt, l2_retrieved

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

# The attention layer's bytes in one 256-token chunk: K and V x 2 KV heads x 64 x bf16.
ATTENTION_CHUNK_BYTES = 2 * 256 * 2 * 64 * 2
# The state group's: one state page per GDN layer (3), as LMCache views it (measured).
STATE_CHUNK_BYTES = 110_592
# `<model>@<kv_rank as 8 hex>@<object group hex>@<chunk hash hex>` (LMCache's MP key)
MP_KEY = re.compile(
    r"^(?P<model>.+)@(?P<rank>[0-9a-f]{8})@(?P<group>[0-9a-f]+)@(?P<hash>[0-9a-f]+)$"
)


def client(tmp: Path, model: Path, name: str, kind: str, separate: bool, kv: KvServer) -> Client:
    """A fresh vLLM (importing from now on) with, at `start`, a fresh `lmcache server`."""
    return Client(tmp, PATHS[kind], model, name, kv, hybrid=True, separate=separate)


def groups(kv: KvServer, keys: set[str]) -> dict[str, set[str]]:
    """`keys` by object group; every key must be an MP key of the hybrid model."""
    out: dict[str, set[str]] = {}
    for key in keys:
        m = MP_KEY.match(key)
        assert m, key
        out.setdefault(m["group"], set()).add(key)
    return out


def state_keys(kv: KvServer, keys: set[str], attention: bool = True) -> set[str]:
    """The recurrent-state group's keys, told from the attention group's by their objects'
    size; `attention`: `keys` must hold the attention group too."""
    with kv.resp() as r:
        sizes = {g: {r.strlen(k) for k in ks} for g, ks in groups(kv, keys).items()}
    want = [STATE_CHUNK_BYTES] + ([ATTENTION_CHUNK_BYTES] if attention else [])
    assert sorted(sizes.values(), key=min) == [{n} for n in sorted(want)], sizes
    state = [g for g, s in sizes.items() if s == {STATE_CHUNK_BYTES}]
    return groups(kv, keys)[state[0]]


def load(p: Client, kv: KvServer, prompt: str, gets: int) -> dict[str, Any]:
    """`prompt` through `p`: its 768 tokens must come from our server."""
    before, mark = kv.stats(), len(p.log())
    result = p.vllm.generate(prompt, f"{p.name}-{prompt}")
    after = kv.stats()
    log = p.log()[mark:]
    assert result["num_cached_tokens"] == REUSABLE, result
    assert l2_retrieved(log) == gets, log[-3000:]
    assert f"Retrieved {REUSABLE} tokens" in log, log[-3000:]
    assert after["get_hits"] - before["get_hits"] == gets, (before, after)
    return result


@pytest.mark.parametrize("separate", [False, True], ids=["one-group", "separate-groups"])
def test_hybrid_native_plugin(tmp_path: Path, hybrid_model: Path, separate: bool) -> None:
    kv = KvServer(tmp_path / "kv")
    try:
        name = "hybrid-native-separate" if separate else "hybrid-native"
        p1 = client(tmp_path, hybrid_model, f"{name}-p1", "native", separate, kv)
        p2 = client(tmp_path, hybrid_model, f"{name}-p2", "native", separate, kv)
        p1.start(kv)
        per_prompt = 6 if separate else 3  # chunks x object groups
        x1 = p1.vllm.generate("x", f"{name}-p1")
        assert x1["num_cached_tokens"] == 0, x1
        wait_stored(kv, per_prompt)
        keys_x = kv.keys()
        if separate:
            y1 = p1.vllm.generate("y", f"{name}-p1-y")
            wait_stored(kv, 2 * per_prompt)
            keys_y = kv.keys() - keys_x
            assert len(keys_y) == per_prompt
        p1.close()
        # tests/e2e/lmcache_cpu_mp.py's second fix moved vLLM's own views of its KV memory
        assert re.search(r"re-pointed [1-9]\d* more views", p1.vllm.text())
        assert len(keys_x) == per_prompt
        assert len(groups(kv, keys_x)) == (2 if separate else 1)
        if separate:
            corrupt(kv, state_keys(kv, keys_y))

        p2.start(kv)
        # Separate groups: 3 attention objects, and the state of the last chunk only (a
        # recurrent layer needs the state where the reuse ends, not before).
        x2 = load(p2, kv, "x", 4 if separate else 3)
        assert x2["output_token_ids"] == x1["output_token_ids"]
        if separate:
            y2 = load(p2, kv, "y", 4)
            assert y2["output_token_ids"] != y1["output_token_ids"], (
                "zeroed recurrent state loaded and the output did not change"
            )
        p2.close()
    finally:
        kv.stop()


def test_hybrid_resp_adapter_one_group(tmp_path: Path, hybrid_model: Path) -> None:
    kv = KvServer(tmp_path / "kv")
    try:
        p1 = client(tmp_path, hybrid_model, "hybrid-resp-p1", "resp", False, kv)
        p2 = client(tmp_path, hybrid_model, "hybrid-resp-p2", "resp", False, kv)
        p1.start(kv)
        x1 = p1.vllm.generate("x", "hybrid-resp-p1")
        wait_stored(kv, 3)
        p1.close()
        p2.start(kv)
        x2 = load(p2, kv, "x", 3)
        assert x2["output_token_ids"] == x1["output_token_ids"]
        p2.close()
    finally:
        kv.stop()


def mixed_size_batch(kv: KvServer, name: str, sizes: list[int]) -> tuple[str, set[str]]:
    """LMCache's C++ RESP client (the MP `resp` adapter's) storing one batch of values of
    `sizes` in our server: its completion's error text ('' if it succeeded), and which of
    the batch's keys our server then holds."""
    from lmcache.lmcache_redis import LMCacheRedisClient

    client = LMCacheRedisClient("127.0.0.1", kv.resp_port, 1, "", TOKEN_A)
    try:
        keys = [f"{name}-{i}" for i in range(len(sizes))]
        fid = client.submit_batch_set(keys, [memoryview(bytearray(n)) for n in sizes])
        done: dict[int, tuple[bool, str]] = {}

        def completed() -> tuple[bool, str] | None:
            for cfid, ok, err, _ in client.drain_completions():
                done[int(cfid)] = (bool(ok), str(err))
            return done.get(fid)

        ok, err = wait_until("the RESP client's completion", completed, 30)
        return ("" if ok else err), kv.keys() & set(keys)
    finally:
        client.close()


def test_hybrid_resp_adapter_separate_groups_cannot_store(
    tmp_path: Path, hybrid_model: Path
) -> None:
    """LMCache 0.5.6's C++ RESP client writes a batch's values up to the first whose size
    differs from the first value's, then fails the whole batch ("buffer size mismatch",
    against redis-server too). With separate object groups every chunk's store is such a
    batch (its state object, then its attention object): LMCache counts each store
    failed, the state objects reach our server and the attention objects never do, so
    nothing can be loaded. Pinned, so a fixed LMCache shows here."""
    kv = KvServer(tmp_path / "kv")
    try:
        p1 = client(tmp_path, hybrid_model, "hybrid-resp-separate", "resp", True, kv)
        p1.start(kv)
        x1 = p1.vllm.generate("x", "hybrid-resp-separate")
        assert x1["num_cached_tokens"] == 0, x1
        assert p1.lmc is not None
        lmc = p1.lmc
        failed = re.compile(r"Store task \d+ to adapter 0 failed for keys: (.*)")
        wait_until("3 failed stores", lambda: len(failed.findall(lmc.text())) >= 3, 60)
        for keys in failed.findall(lmc.text()):
            assert "object_group_id=0" in keys, keys
            assert "object_group_id=1" in keys, keys
        p1.close()
        stored = kv.keys()
        assert len(stored) == 3
        assert state_keys(kv, stored, attention=False) == stored
        # The reason, from the client itself: a state object, then an attention object.
        err, kept = mixed_size_batch(kv, "mixed", [STATE_CHUNK_BYTES, ATTENTION_CHUNK_BYTES])
        assert "buffer size mismatch" in err
        assert kept == {"mixed-0"}
        assert mixed_size_batch(kv, "same", [ATTENTION_CHUNK_BYTES] * 2) == (
            "",
            {"same-0", "same-1"},
        )
    finally:
        kv.stop()


def test_hybrid_v1_connector_does_not_start(tmp_path: Path, hybrid_model: Path) -> None:
    """vLLM 0.32 turns its hybrid KV-cache manager off for LMCache's v1 connector, and a
    hybrid model then does not start: MP mode is the only LMCache path for it. Pinned
    (Path A's settings), so a vLLM or LMCache that supports it shows here."""
    kv = KvServer(tmp_path / "kv")
    try:
        p = Client(tmp_path, PATHS["path-a"], hybrid_model, "hybrid-v1", kv, hybrid=True)
        with pytest.raises(RuntimeError, match="process exited"):
            p.start(kv)
        assert "Turning off hybrid kv cache manager" in p.vllm.text()
        assert "Failed to promote local KV cache specs to one unified type" in p.vllm.text()
        assert kv.keys() == set()
    finally:
        kv.stop()

"""Bundle cache backends and the resolution chain (override > remote > in-process)."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from epistemic_kvcache.context import (
    NullBundleCache,
    TTLBundleCache,
    reset_context_compiler_cache,
    resolve_context_compiler_cache,
    set_context_compiler_cache,
)
from epistemic_kvcache.errors import ConfigurationError

ENV = (
    "MODEL_CONTEXT_COMPILER_CACHE_ENABLED",
    "EPISTEMIC_GRAPH_KVCACHE_URL",
    "EPISTEMIC_GRAPH_KVCACHE_ADDR",
    "EPISTEMIC_GRAPH_KVCACHE_TOKEN",
    "EPISTEMIC_GRAPH_KVCACHE_CLIENT_CERT",
    "EPISTEMIC_GRAPH_KVCACHE_CLIENT_KEY",
)


@pytest.fixture(autouse=True)
def clean_chain(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    reset_context_compiler_cache()
    yield
    reset_context_compiler_cache()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# -- TTLBundleCache --------------------------------------------------------------------


def test_ttl_cache_expires_entries() -> None:
    clock = Clock()
    c = TTLBundleCache(ttl_s=10, clock=clock)
    assert c.put("k", b"v")
    assert c.get("k") == b"v"
    clock.now += 9.9
    assert c.get("k") == b"v"
    clock.now += 0.1
    assert c.get("k") is None
    assert len(c) == 0
    assert c.nbytes == 0


def test_ttl_cache_is_lru_bounded_by_entries_and_bytes() -> None:
    c = TTLBundleCache(max_entries=3, max_bytes=100)
    for k in "abc":
        c.put(k, b"x" * 10)
    assert c.get("a") == b"x" * 10  # a is now most recent
    c.put("d", b"y" * 10)
    assert c.get("b") is None
    assert [c.get(k) is not None for k in "acd"] == [True, True, True]
    c.put("big", b"z" * 95)  # evicts until the bytes fit
    assert c.nbytes <= 100
    assert c.get("big") == b"z" * 95
    assert len(c) == 1
    assert not c.put("huge", b"z" * 101)
    c.put("big", b"1")  # replacing adjusts the byte count
    assert c.nbytes == 1
    assert c.delete("big")
    assert not c.delete("big")
    with pytest.raises(ValueError, match="ttl_s"):
        TTLBundleCache(ttl_s=0)


def test_null_cache_holds_nothing() -> None:
    n = NullBundleCache()
    assert not n.put("k", b"v")
    assert n.get("k") is None


# -- resolution chain ------------------------------------------------------------------


class FakeRemote:
    built: list[FakeRemote] = []

    def __init__(self) -> None:
        self.closed = False
        FakeRemote.built.append(self)

    @classmethod
    def from_env(cls) -> FakeRemote:
        return cls()

    def get(self, key: str) -> bytes | None:
        return None

    def put(self, key: str, value: bytes) -> bool:
        return True

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_client(monkeypatch: pytest.MonkeyPatch) -> type[FakeRemote]:
    """Replace `epistemic_kvcache.client` so the remote branch builds a FakeRemote."""
    mod: Any = types.ModuleType("epistemic_kvcache.client")
    mod.EpistemicGraphKVBackend = FakeRemote
    monkeypatch.setitem(sys.modules, "epistemic_kvcache.client", mod)
    FakeRemote.built = []
    return FakeRemote


def test_default_is_one_process_wide_ttl_cache() -> None:
    a = resolve_context_compiler_cache()
    assert isinstance(a, TTLBundleCache)
    assert resolve_context_compiler_cache() is a


def test_override_wins_and_none_clears(
    monkeypatch: pytest.MonkeyPatch, fake_client: type[FakeRemote]
) -> None:
    monkeypatch.setenv("MODEL_CONTEXT_COMPILER_CACHE_ENABLED", "true")
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_URL", "http://127.0.0.1:1")
    mine = TTLBundleCache()
    set_context_compiler_cache(mine)
    assert resolve_context_compiler_cache() is mine
    assert fake_client.built == []  # the override short-circuits remote construction
    set_context_compiler_cache(None)
    assert isinstance(resolve_context_compiler_cache(), FakeRemote)


@pytest.mark.parametrize("var", ["EPISTEMIC_GRAPH_KVCACHE_URL", "EPISTEMIC_GRAPH_KVCACHE_ADDR"])
def test_enabled_with_address_builds_remote_lazily_once(
    monkeypatch: pytest.MonkeyPatch, fake_client: type[FakeRemote], var: str
) -> None:
    monkeypatch.setenv("MODEL_CONTEXT_COMPILER_CACHE_ENABLED", "True")
    monkeypatch.setenv(var, "127.0.0.1:1" if var.endswith("ADDR") else "http://127.0.0.1:1")
    assert fake_client.built == []
    first = resolve_context_compiler_cache()
    assert isinstance(first, FakeRemote)
    assert resolve_context_compiler_cache() is first
    assert len(fake_client.built) == 1
    # A changed address rebuilds (and closes the old client).
    monkeypatch.setenv(var, "127.0.0.1:2" if var.endswith("ADDR") else "http://127.0.0.1:2")
    second = resolve_context_compiler_cache()
    assert second is not first
    assert first.closed


@pytest.mark.parametrize(
    ("enabled", "url"),
    [("false", "http://127.0.0.1:1"), ("", "http://127.0.0.1:1"), ("true", None)],
)
def test_disabled_or_no_address_falls_to_in_process(
    monkeypatch: pytest.MonkeyPatch,
    fake_client: type[FakeRemote],
    enabled: str,
    url: str | None,
) -> None:
    monkeypatch.setenv("MODEL_CONTEXT_COMPILER_CACHE_ENABLED", enabled)
    if url:
        monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_URL", url)
    assert isinstance(resolve_context_compiler_cache(), TTLBundleCache)
    assert fake_client.built == []


def test_bad_enabled_value_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MODEL_CONTEXT_COMPILER_CACHE_ENABLED", "maybe")
    with pytest.raises(ConfigurationError, match="MODEL_CONTEXT_COMPILER_CACHE_ENABLED"):
        resolve_context_compiler_cache()


def test_enabled_without_importable_client_is_a_configuration_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "epistemic_kvcache.client", types.ModuleType("empty"))
    monkeypatch.setenv("MODEL_CONTEXT_COMPILER_CACHE_ENABLED", "1")
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_ADDR", "127.0.0.1:1")
    with pytest.raises(ConfigurationError, match="cannot be imported"):
        resolve_context_compiler_cache()


def test_enabled_builds_the_real_client_when_it_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    client = pytest.importorskip("epistemic_kvcache.client")
    monkeypatch.setenv("MODEL_CONTEXT_COMPILER_CACHE_ENABLED", "true")
    monkeypatch.setenv("EPISTEMIC_GRAPH_KVCACHE_URL", "http://127.0.0.1:9")
    backend = resolve_context_compiler_cache()
    assert isinstance(backend, client.EpistemicGraphKVBackend)
    # Nothing listens on port 9: the client degrades to a miss, never raises.
    assert backend.get("ctxbundle:" + "0" * 64) is None


def test_compile_without_backend_uses_the_chain() -> None:
    from epistemic_kvcache.context import (
        Candidate,
        ContextCompiler,
        InMemoryCandidateSource,
        Session,
    )

    mine = TTLBundleCache()
    set_context_compiler_cache(mine)
    comp = ContextCompiler(
        InMemoryCandidateSource([Candidate("a", "kv", "doc://a", 0, tenant="t")])
    )
    b = comp.compile("kv", Session("s", "t"))
    assert mine.get(b.cache_key) == b.to_bytes()
    assert comp.compile("kv", Session("s", "t")).kv_cache_hit

"""Client API edges: explicit put outcomes, None refused, positional URL, plain-http
opt-in, and the timeout / breaker settings."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from epistemic_kvcache.client import EpistemicGraphKVBackend, KvCacheConfig, PutOutcome
from epistemic_kvcache.errors import ConfigurationError
from servers import TOKEN, ServeProcess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    s = ServeProcess(tmp_path_factory.mktemp("kv"))
    yield s
    s.stop()


@pytest.fixture
def kv(server: ServeProcess) -> Iterator[EpistemicGraphKVBackend]:
    with EpistemicGraphKVBackend(base_url=server.url(), token=TOKEN) as c:
        yield c


def test_put_outcomes_are_explicit(kv: EpistemicGraphKVBackend) -> None:
    key = f"outcome-{os.urandom(4).hex()}"
    first, other = os.urandom(1000), os.urandom(1000)
    assert kv.put(key, first) is PutOutcome.NEW
    assert kv.put(key, first) is PutOutcome.DUPLICATE  # same bytes: nothing written
    again = kv.put(key, other)
    if again is PutOutcome.CONFLICT:  # a first-write-wins server: refused, and falsy
        assert not again
        assert kv.get(key) == first
    else:  # Redis semantics: the key now holds the new bytes
        assert again is PutOutcome.REPLACED
        assert kv.get(key) == other
    batch = kv.put_many([(key + "-b", first), (key + "-b", first)])
    assert batch == [PutOutcome.NEW, PutOutcome.DUPLICATE]


def test_outcome_truthiness_and_words() -> None:
    assert [bool(o) for o in PutOutcome] == [True, True, True, False, False, False, False]
    assert [o.stored for o in PutOutcome] == [bool(o) for o in PutOutcome]
    assert PutOutcome.from_word("created") is PutOutcome.NEW
    assert PutOutcome.from_word("replaced") is PutOutcome.REPLACED
    assert PutOutcome.from_word("error:quota") is PutOutcome.FAILED
    assert PutOutcome.from_word(None) is PutOutcome.FAILED


def test_put_none_or_text_is_a_type_error_and_stores_nothing(kv: EpistemicGraphKVBackend) -> None:
    with pytest.raises(TypeError, match=r"put\('nothing', None\).*use delete\(\)"):
        kv.put("nothing", None)
    with pytest.raises(TypeError, match=r"bytes-like object .* not str"):
        kv.put("nothing", "text")
    with pytest.raises(TypeError, match="put\\('b', None\\)"):
        kv.put_many([("a", b"x"), ("b", None)])  # type: ignore[list-item]
    assert kv.exists_many(["nothing", "a", "b"]) == [False, False, False]  # nothing sent


def test_positional_url_is_a_clear_type_error() -> None:
    with pytest.raises(TypeError, match=r"base_url='http://127.0.0.1:9130', token=\.\.\."):
        EpistemicGraphKVBackend("http://127.0.0.1:9130")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not a positional dict"):
        EpistemicGraphKVBackend({"base_url": "x"})  # type: ignore[arg-type]


def test_plain_http_to_another_host_needs_the_explicit_opt_in(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="allow_insecure_http=True"):
        KvCacheConfig(base_url="http://10.0.0.5:9130")
    cfg = KvCacheConfig(base_url="http://10.0.0.5:9130", allow_insecure_http=True)
    assert cfg.scheme == "http"
    with pytest.raises(ConfigurationError, match="allow_insecure_http"):
        KvCacheConfig(base_url="http://10.0.0.5:9130", allow_insecure_http="yes")  # type: ignore[arg-type]
    env = {"EPISTEMIC_GRAPH_KVCACHE_URL": "http://10.0.0.5:9130"}
    with pytest.raises(ConfigurationError, match="plain http"):
        KvCacheConfig.from_env(env)
    on = {**env, "EPISTEMIC_GRAPH_KVCACHE_CLIENT_ALLOW_INSECURE_HTTP": "1"}
    assert KvCacheConfig.from_env(on).allow_insecure_http is True
    bad = {**env, "EPISTEMIC_GRAPH_KVCACHE_CLIENT_ALLOW_INSECURE_HTTP": "maybe"}
    with pytest.raises(ConfigurationError, match="expected true or false"):
        KvCacheConfig.from_env(bad)
    # The opt-in is about encryption, not identity: still no client certificate over http.
    cert = tmp_path / "c.pem"
    cert.write_text("x")
    with pytest.raises(ConfigurationError, match="client certificate needs an https"):
        KvCacheConfig(base_url="http://10.0.0.5:1", allow_insecure_http=True, client_cert=str(cert))


def test_timeout_and_breaker_settings() -> None:
    cfg = KvCacheConfig()
    assert (cfg.lookup_timeout_s, cfg.read_timeout_s, cfg.connect_timeout_s) == (1.0, 2.0, 2.0)
    assert cfg.breaker_max_backoff_s == 5.0
    for bad in ({"lookup_timeout_s": 0}, {"lookup_timeout_s": True}, {"read_timeout_s": -1}):
        with pytest.raises(ConfigurationError, match="positive number of seconds"):
            KvCacheConfig(**bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="breaker_max_backoff_s"):
        KvCacheConfig(breaker_max_backoff_s=-1)
    env = {
        "EPISTEMIC_GRAPH_KVCACHE_CLIENT_LOOKUP_TIMEOUT_S": "0.25",
        "EPISTEMIC_GRAPH_KVCACHE_CLIENT_BREAKER_MAX_BACKOFF_S": "0",
    }
    cfg = KvCacheConfig.from_env(env)
    assert (cfg.lookup_timeout_s, cfg.breaker_max_backoff_s) == (0.25, 0.0)
    with EpistemicGraphKVBackend(cfg) as c:
        assert c.breaker is None  # 0 turns it off
    with EpistemicGraphKVBackend() as c:
        assert c.breaker is not None
        assert not c.breaker.is_open


def test_conditional_puts(kv: EpistemicGraphKVBackend) -> None:
    key = f"cond-{os.urandom(4).hex()}"
    assert kv.put(key, b"first", cond="xx") is PutOutcome.MISSING
    assert kv.exists(key) is False
    assert kv.put(key, b"first", cond="nx") is PutOutcome.NEW
    assert kv.put(key, b"second", cond="nx") is PutOutcome.CONFLICT
    assert kv.get(key) == b"first"
    assert kv.put(key, b"second", cond="xx") is PutOutcome.REPLACED
    assert kv.get(key) == b"second"
    with pytest.raises(ValueError, match="invalid cond"):
        kv.put(key, b"x", cond="maybe")  # type: ignore[arg-type]

"""Server and client never read one variable for different things; each warns only about
its own names; old client names keep working with a warning; first-write-wins tenants."""

from __future__ import annotations

import logging

import pytest

from epistemic_kvcache.client.config import KvCacheConfig
from epistemic_kvcache.config import load_config

P = "EPISTEMIC_GRAPH_KVCACHE_"


def test_client_pool_size_does_not_touch_the_server() -> None:
    env = {P + "CLIENT_MAX_CONNECTIONS": "16"}
    assert load_config({}, env).limits.max_connections == 1024
    assert load_config({}, env).warnings == ()
    assert KvCacheConfig.from_env(env).max_connections == 16


def test_server_is_silent_about_client_variables() -> None:
    env = {
        P + "URL": "http://127.0.0.1:1",
        P + "CLIENT_CERT": "c.pem",
        P + "CLIENT_READ_TIMEOUT_S": "3",
        P + "CLIENT_WHATEVER": "x",
        P + "CONNECT_TIMEOUT_S": "1",  # deprecated client name
        P + "READ_TIMEOUT_S": "1",  # deprecated client name
        P + "TOKEN": "s" * 32,  # shared on purpose
    }
    config = load_config({}, env)
    assert config.warnings == ()
    assert config.tokens == ("s" * 32,)


def test_server_warns_about_its_own_unknown_names() -> None:
    config = load_config({}, {P + "IDLE_TIMEOUT": "3"})
    assert config.warnings == (
        f"unknown environment variable {P}IDLE_TIMEOUT ignored (did you mean {P}IDLE_TIMEOUT_S?)",
    )


def test_client_reads_new_names(caplog: pytest.LogCaptureFixture) -> None:
    env = {
        P + "CLIENT_CONNECT_TIMEOUT_S": "1.5",
        P + "CLIENT_READ_TIMEOUT_S": "7.5",
        P + "CLIENT_MAX_CONNECTIONS": "4",
        P + "IDLE_TIMEOUT_S": "9",  # a server setting: not the client's business
        P + "MAX_BLOCK_BYTES": "1MiB",
    }
    with caplog.at_level(logging.WARNING):
        c = KvCacheConfig.from_env(env)
    assert (c.connect_timeout_s, c.read_timeout_s, c.max_connections) == (1.5, 7.5, 4)
    assert caplog.records == []


def test_client_old_names_still_work_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    env = {P + "READ_TIMEOUT_S": "7.5", P + "MAX_CONNECTIONS": "8"}
    with caplog.at_level(logging.WARNING):
        c = KvCacheConfig.from_env(env)
    assert (c.read_timeout_s, c.max_connections) == (7.5, 8)
    text = caplog.text
    assert f"{P}READ_TIMEOUT_S is deprecated for the client: set {P}CLIENT_READ_TIMEOUT_S" in text
    assert f"{P}MAX_CONNECTIONS is deprecated for the client" in text
    # The new name wins over the old one.
    env[P + "CLIENT_MAX_CONNECTIONS"] = "2"
    assert KvCacheConfig.from_env(env).max_connections == 2


def test_client_warns_about_unknown_client_names(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        KvCacheConfig.from_env({P + "CLIENT_MAX_CONECTIONS": "8"})
    assert (
        f"unknown environment variable {P}CLIENT_MAX_CONECTIONS ignored "
        f"(did you mean {P}CLIENT_MAX_CONNECTIONS?)"
    ) in caplog.text


def test_bad_client_value_names_the_variable() -> None:
    with pytest.raises(ValueError, match=f"invalid {P}CLIENT_READ_TIMEOUT_S"):
        KvCacheConfig.from_env({P + "CLIENT_READ_TIMEOUT_S": "soon"})
    with pytest.raises(ValueError, match=f"invalid {P}READ_TIMEOUT_S"):
        KvCacheConfig.from_env({P + "READ_TIMEOUT_S": "soon"})


def test_first_write_wins_tenants() -> None:
    assert load_config({}, {}).store.first_write_wins is False
    c = load_config({"first_write_wins_tenants": "a,b"}, {})
    assert c.first_write_wins_tenants == ("a", "b")
    assert c.store.first_write_wins == frozenset({"a", "b"})
    c = load_config({}, {P + "FIRST_WRITE_WINS_TENANTS": "*"})
    assert c.store.first_write_wins is True


def test_client_token_from_a_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "token"
    f.write_text("# mounted secret\n\ns3cr3t-token tenant-ignored\n")
    assert KvCacheConfig.from_env({P + "CLIENT_TOKEN_FILE": str(f)}).token == "s3cr3t-token"
    env = {P + "CLIENT_TOKEN_FILE": str(f), P + "TOKEN": "direct"}
    assert KvCacheConfig.from_env(env).token == "direct"  # the variable wins over the file
    with pytest.raises(ValueError, match=f"invalid {P}CLIENT_TOKEN_FILE: cannot read"):
        KvCacheConfig.from_env({P + "CLIENT_TOKEN_FILE": str(tmp_path / "missing")})

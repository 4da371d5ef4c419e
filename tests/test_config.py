"""Configuration: precedence flag > env > TOML > default, parsing, eager validation."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from epistemic_kvcache.config import (
    SETTINGS,
    Address,
    ServerConfig,
    add_arguments,
    effective_settings,
    format_size,
    is_loopback_host,
    load_config,
    parse_size,
)
from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.server.context import ServerLimits
from epistemic_kvcache.server.tls import check_bind

GiB = 1 << 30
MiB = 1 << 20


def _parse_flags(*argv: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args(list(argv)))


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvcache.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    c = load_config({}, {})
    assert c.addr == Address("127.0.0.1", 9130)
    assert c.resp_addr == Address("127.0.0.1", 6379)
    assert c.backend == "durable"
    assert c.persist_dir == Path("kvcache-data")
    assert c.jwt_tenant_claim == "tenant"
    assert c.store.dedup_scope == "namespace"
    assert c.limits == ServerLimits()
    assert c.stats_log_interval_s == 60.0
    assert not c.auth_configured
    assert c.generate_token
    assert c.warnings == ()
    assert c == ServerConfig(limits=ServerLimits())


def test_receive_prefault_bytes_zero_turns_the_pool_off() -> None:
    assert load_config({"receive_prefault_bytes": "0"}, {}).limits.receive_prefault_bytes == 0
    assert load_config({"receive_prefault_bytes": "64MiB"}, {}).limits.receive_prefault_bytes == (
        64 << 20
    )
    with pytest.raises(ConfigurationError, match="max_block_bytes"):
        load_config({"max_block_bytes": "0"}, {})  # other sizes must still be positive


def test_precedence_flag_env_toml_default(tmp_path: Path) -> None:
    path = _toml(
        tmp_path,
        'hot_capacity_bytes = "3GiB"\nwarm_capacity_bytes = 1024\nlog_level = "debug"\n'
        'dedup_scope = "global"\n',
    )
    env = {
        "EPISTEMIC_GRAPH_KVCACHE_HOT_CAPACITY_BYTES": "2GiB",
        "EPISTEMIC_GRAPH_KVCACHE_WARM_CAPACITY_BYTES": "2MiB",
        "EPISTEMIC_GRAPH_KVCACHE_CONFIG": str(path),
    }
    c = load_config(_parse_flags("--hot-capacity-bytes", "1GiB"), env)
    assert c.store.hot_capacity_bytes == GiB  # flag beats env and TOML
    assert c.store.warm_capacity_bytes == 2 * MiB  # env beats TOML
    assert c.log_level == "DEBUG"  # TOML beats default
    assert c.store.dedup_scope == "global"
    assert c.store.cold_capacity_bytes == ServerConfig().store.cold_capacity_bytes  # default
    assert c.config_file == path
    # --config beats the env variable naming the file.
    other = _toml(tmp_path / "..", 'log_level = "error"\n')
    c = load_config(_parse_flags("--config", str(other)), env)
    assert c.log_level == "ERROR"


def test_a_toml_key_overridden_by_a_higher_layer_is_named(tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("tok-0123456789abcdef\n")
    path = _toml(
        tmp_path,
        'token_file = "tokens"\nlog_level = "debug"\naddr = "127.0.0.1:7000"\n'
        'jwt_secret = "' + "s" * 40 + '"\n',
    )
    env = {
        "EPISTEMIC_GRAPH_KVCACHE_LOG_LEVEL": "debug",  # the same value: nothing lost
        "EPISTEMIC_GRAPH_KVCACHE_JWT_SECRET": "t" * 40,  # a secret: no value shown
    }
    c = load_config(_parse_flags("--config", str(path), "--addr", "127.0.0.1:7001"), env)
    assert c.warnings == (
        f"{path} key addr is overridden by --addr ('127.0.0.1:7000' -> '127.0.0.1:7001'): "
        "the file's value is not used (precedence: flag > environment > config file)",
        f"{path} key jwt_secret is overridden by environment EPISTEMIC_GRAPH_KVCACHE_JWT_SECRET: "
        "the file's value is not used (precedence: flag > environment > config file)",
    )
    # the deploy failure this explains: the image's variable names a file nobody mounted
    env = {"EPISTEMIC_GRAPH_KVCACHE_TOKEN_FILE": str(tmp_path / "run" / "kvcache-tokens")}
    with pytest.raises(ConfigurationError) as info:
        load_config(_parse_flags("--config", str(path)), env)
    assert str(info.value) == (
        f"invalid token_file: file not found (got '{tmp_path}/run/kvcache-tokens') ({path} key "
        f"token_file is overridden by environment EPISTEMIC_GRAPH_KVCACHE_TOKEN_FILE "
        f"('{tokens}' -> '{tmp_path}/run/kvcache-tokens'))"
    )
    assert load_config(
        {}, {"EPISTEMIC_GRAPH_KVCACHE_TOKEN_FILE": ""}, config_file=path
    ).token_file == (
        tokens  # an empty variable is unset: the file's value stands
    )


def test_special_names() -> None:
    env = {
        "EPISTEMIC_GRAPH_KVCACHE_ADDR": "0.0.0.0:9000",
        "EPISTEMIC_GRAPH_KVCACHE_BACKEND": "memory",
        "GRAPH_SERVICE_PERSIST_DIR": "/srv/kv",
        "EPISTEMIC_GRAPH_KVCACHE_TOKEN": "env-token-0123456789",
        # The client's variables share the prefix and are not warned about.
        "EPISTEMIC_GRAPH_KVCACHE_URL": "https://kv:9130",
        "EPISTEMIC_GRAPH_KVCACHE_CLIENT_CERT": "/c.pem",
        "EPISTEMIC_GRAPH_KVCACHE_CLIENT_KEY": "/k.pem",
    }
    c = load_config({}, env)
    assert c.addr == Address("0.0.0.0", 9000)
    assert c.backend == "memory"
    assert c.persist_dir == Path("/srv/kv")
    assert c.tokens == ("env-token-0123456789",)
    assert c.warnings == ()
    # The project-specific name wins over the alias; the flag wins over both.
    env["EPISTEMIC_GRAPH_KVCACHE_PERSIST_DIR"] = "/srv/kv2"
    assert load_config({}, env).persist_dir == Path("/srv/kv2")
    assert load_config(_parse_flags("--persist-dir", "/x"), env).persist_dir == Path("/x")


def test_flags_parse_every_kind() -> None:
    c = load_config(
        _parse_flags(
            "--addr",
            "[::1]:0",
            "--resp-addr",
            "off",
            "--token",
            "tok-one-0123456789",
            "--token",
            "tok-two-0123456789",
            "--allow-insecure-bind",
            "--no-generate-token",
            "--max-block-bytes",
            "64MiB",
            "--request-timeout-s",
            "2.5",
            "--max-connections",
            "10",
            "--stats-log-interval-s",
            "0",
        ),
        {},
    )
    assert c.addr == Address("::1", 0)
    assert str(c.addr) == "[::1]:0"
    assert c.resp_addr is None
    assert c.tokens == ("tok-one-0123456789", "tok-two-0123456789")
    assert c.allow_insecure_bind is True
    assert c.generate_token is False
    assert c.max_block_bytes == c.limits.max_block_bytes == 64 * MiB
    assert c.limits.request_timeout_s == 2.5
    assert c.limits.max_connections == 10
    assert c.stats_log_interval_s == 0.0
    assert c.store.max_block_bytes == 64 * MiB


def test_store_options_are_filled_from_the_settings_of_the_same_names() -> None:
    c = load_config(
        {
            "hot_capacity_bytes": "2MiB",
            "max_block_bytes": "64MiB",
            "cluster_key_prefix": "abc",
            "first_write_wins_tenants": "*",
            "rebuild_index": "true",
        },
        {},
    )
    assert c.store == StoreOptions(
        hot_capacity_bytes=2 * MiB,
        max_block_bytes=64 * MiB,
        cluster_key_prefix="abc",
        first_write_wins=True,
        rebuild_index=True,
    )
    shown = {name: value for name, value, _source in effective_settings(c)}
    assert shown["hot_capacity_bytes"] == "2MiB"
    assert shown["cluster_key_prefix"] == "abc"
    assert load_config({}, {}).store == StoreOptions()  # the setting defaults are its own


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("hot_capacity_bytes", -1, "invalid hot_capacity_bytes: expected a non-negative integer"),
        ("cold_capacity_bytes", 0, "invalid cold_capacity_bytes: expected a positive integer"),
        ("max_block_bytes", 0, "invalid max_block_bytes: expected a positive integer"),
        ("dedup_scope", "tenant", "invalid dedup_scope: expected namespace or global"),
        ("max_pinned_fraction", 0.0, r"invalid max_pinned_fraction: expected \(0, 1\]"),
        ("max_snapshots_per_tenant", 0, "invalid max_snapshots_per_tenant: expected a positive"),
        ("max_keys_per_tenant", -1, "invalid max_keys_per_tenant: expected 0 \\(no limit\\)"),
        ("first_write_wins", "a", "invalid first_write_wins: expected a bool or a frozenset"),
        ("cluster_wait_replicas", -1, "invalid cluster_wait_replicas: expected 0 or more"),
        ("cluster_retry_window_s", 0, "invalid cluster_retry_window_s: expected > 0"),
        ("cluster_key_prefix", "a:b", "invalid cluster_key_prefix: expected a word without"),
    ],
)
def test_store_options_refuse_a_bad_value_naming_it(
    field: str, value: object, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message + r".*\(got " + re.escape(repr(value))):
        StoreOptions(**{field: value})  # type: ignore[arg-type]


def test_secrets_not_in_repr() -> None:
    c = load_config({"token": ["tok-secret-0123456789"], "jwt_secret": "j" * 40}, {})
    assert "tok-secret" not in repr(c)
    assert "jjjj" not in repr(c)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 * GiB),
        ("512MiB", 512 * MiB),
        ("1G", 10**9),
        ("1g", 10**9),
        ("1GB", GiB),  # redis.conf's units: 1gb is 1024**3 (tests/test_config_sizes.py)
        ("1.5GiB", 3 * GiB // 2),
        ("64KiB", 64 * 1024),
        ("1048576", 1 << 20),
        ("1_000", 1000),
        ("2 TiB", 2 << 40),
        (" 7b ", 7),
        (4096, 4096),
    ],
)
def test_parse_size(text: Any, expected: int) -> None:
    assert parse_size(text) == expected


def test_format_size() -> None:
    assert format_size(GiB) == "1GiB"
    assert format_size(3 * MiB) == "3MiB"
    assert format_size(1000) == "1000"


# (setting via flag, raw value, expected message fragment)
INVALID = [
    (
        "hot_capacity_bytes",
        "-1",
        "invalid hot_capacity_bytes: expected a size like 4GiB, or 0 to turn the tier off "
        "(got '-1')",
    ),
    (
        "warm_capacity_bytes",
        "lots",
        "invalid warm_capacity_bytes: expected a size like 4GiB, or 0 to turn the tier off "
        "(got 'lots')",
    ),
    (
        "cold_capacity_bytes",
        "0",
        "invalid cold_capacity_bytes: expected a positive size like 4GiB (got '0')",
    ),
    (
        "cold_capacity_bytes",
        "4XB",
        "invalid cold_capacity_bytes: expected a positive size like 4GiB (got '4XB')",
    ),
    ("max_block_bytes", "lots", "invalid max_block_bytes: expected a positive size"),
    ("addr", "localhost", "invalid addr: expected host:port"),
    (
        "addr",
        "127.0.0.1:65536",
        "e.g. 127.0.0.1:9130 or [::1]:9130, port 0..65535 (got '127.0.0.1:65536')",
    ),
    ("addr", "::1:80", "invalid addr: expected host:port"),
    ("addr", "[nope]:80", "invalid addr"),
    (
        "resp_addr",
        "sometimes",
        "invalid resp_addr: expected host:port (e.g. 127.0.0.1:6379) or 'off' (got 'sometimes')",
    ),
    ("backend", "disk", "invalid backend: expected one of durable, memory (got 'disk')"),
    (
        "dedup_scope",
        "tenant",
        "invalid dedup_scope: expected one of namespace, global (got 'tenant')",
    ),
    ("log_level", "loud", "invalid log_level: expected one of debug, info"),
    (
        "request_timeout_s",
        "0",
        "invalid request_timeout_s: expected a number of seconds > 0 (got '0')",
    ),
    ("idle_timeout_s", "nan", "invalid idle_timeout_s"),
    (
        "stats_log_interval_s",
        "-5",
        "invalid stats_log_interval_s: expected a number of seconds >= 0",
    ),
    ("max_connections", "0", "invalid max_connections: expected a positive integer (got '0')"),
    ("max_headers", "many", "invalid max_headers: expected a positive integer (got 'many')"),
    ("store_threads", "5000", "invalid store_threads: expected at most 1024 (got 5000)"),
    ("jwt_algorithms", "none", "'none' is never accepted"),
    ("jwt_algorithms", "HS1", "invalid jwt_algorithms: expected algorithms among HS256"),
    ("jwt_issuer", "iss", "invalid jwt_issuer: no JWT key configured"),
    ("token_file", "/does/not/exist", "invalid token_file: file not found (got '/does/not/exist')"),
    ("tls_cert", "/does/not/exist", "invalid tls_key: --tls-cert and --tls-key go together"),
    ("tls_client_ca", "/does/not/exist", "invalid tls_client_ca: mTLS needs --tls-cert"),
    ("jwt_secret", "short", "invalid jwt_secret: expected at least 32 bytes (got 5 bytes)"),
]


@pytest.mark.parametrize(("name", "raw", "fragment"), INVALID)
def test_invalid_values_name_setting_and_value(name: str, raw: str, fragment: str) -> None:
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ConfigurationError) as info:
        load_config(_parse_flags(flag, raw), {})
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError)


def test_invalid_value_names_its_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="set by --hot-capacity-bytes"):
        load_config({"hot_capacity_bytes": "-1"}, {})
    env = {"EPISTEMIC_GRAPH_KVCACHE_HOT_CAPACITY_BYTES": "-1"}
    with pytest.raises(
        ConfigurationError, match="set by environment EPISTEMIC_GRAPH_KVCACHE_HOT_CAPACITY_BYTES"
    ):
        load_config({}, env)
    path = _toml(tmp_path, "hot_capacity_bytes = -1\n")
    with pytest.raises(ConfigurationError, match=re.escape(f"(got -1); set by {path} key")):
        load_config({}, {}, config_file=path)


def test_secret_values_never_echoed() -> None:
    with pytest.raises(ConfigurationError) as info:
        load_config({"token": ["has space-0123456789"]}, {})
    assert "has space" not in str(info.value)
    assert "value not shown" in str(info.value)


def test_unknown_toml_key_is_an_error(tmp_path: Path) -> None:
    path = _toml(tmp_path, "hot_capacity = 5\n")
    with pytest.raises(ConfigurationError, match="did you mean 'hot_capacity_bytes'"):
        load_config({}, {}, config_file=path)


def test_bad_toml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="not valid TOML"):
        load_config({}, {}, config_file=_toml(tmp_path, "a = = 1\n"))
    with pytest.raises(ConfigurationError, match="file not found"):
        load_config({}, {}, config_file=tmp_path / "missing.toml")


def test_toml_types_and_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "tokens").write_text("tok-0123456789abcdef\n")
    path = _toml(
        tmp_path,
        'token = ["a-token-0123456789", "b-token-0123456789"]\n'
        'token_file = "tokens"\n'
        "allow_insecure_bind = true\n"
        'resp_addr = "off"\n'
        'jwt_secret = "' + "k" * 40 + '"\n'
        'jwt_algorithms = ["HS256", "hs512"]\n'
        "request_timeout_s = 3\n"
        'persist_dir = "data"\n',
    )
    with pytest.raises(ConfigurationError, match="expected at least 64 bytes"):
        load_config({}, {}, config_file=path)
    path.write_text(path.read_text().replace('"hs512"', '"HS384"').replace("k" * 40, "k" * 48))
    c = load_config({}, {}, config_file=path)
    assert c.tokens == ("a-token-0123456789", "b-token-0123456789")
    assert c.token_file == tmp_path / "tokens"
    assert c.persist_dir == tmp_path / "data"
    assert c.allow_insecure_bind is True
    assert c.resp_addr is None
    assert c.jwt_algorithms == ("HS256", "HS384")
    assert c.limits.request_timeout_s == 3.0


def test_unknown_env_vars_warn_with_hint() -> None:
    c = load_config({}, {"EPISTEMIC_GRAPH_KVCACHE_HOT_CAPACITY": "1G", "OTHER": "x"})
    assert c.warnings == (
        "unknown environment variable EPISTEMIC_GRAPH_KVCACHE_HOT_CAPACITY ignored "
        "(did you mean EPISTEMIC_GRAPH_KVCACHE_HOT_CAPACITY_BYTES?)",
    )


def test_per_tenant_connection_cap_is_clamped_to_half_with_a_warning() -> None:
    c = load_config({"max_connections": "100"}, {})
    assert c.limits.max_connections_per_tenant == 512  # as set (the default)
    assert c.limits.tenant_connection_cap == 50  # in force
    assert c.warnings == (
        "max_connections_per_tenant = 512 is clamped to 50, half of max_connections = 100: "
        "one tenant may hold at most half of a listener's connections (raise "
        "max_connections to let a tenant hold more)",
    )
    fits = load_config({"max_connections": "100", "max_connections_per_tenant": "50"}, {})
    assert (fits.limits.tenant_connection_cap, fits.warnings) == (50, ())
    assert load_config({}, {}).limits.tenant_connection_cap == 512  # 1024 / 2: no warning
    assert load_config({"max_connections": "1"}, {}).limits.tenant_connection_cap == 1


def test_bool_env_values() -> None:
    for raw, expected in [("1", True), ("yes", True), ("OFF", False), ("false", False)]:
        env = {"EPISTEMIC_GRAPH_KVCACHE_ALLOW_INSECURE_BIND": raw}
        assert load_config({}, env).allow_insecure_bind is expected
    with pytest.raises(ConfigurationError, match="expected a boolean"):
        load_config({}, {"EPISTEMIC_GRAPH_KVCACHE_ALLOW_INSECURE_BIND": "maybe"})


def test_same_address_twice_refused() -> None:
    with pytest.raises(ConfigurationError, match="same address as addr"):
        load_config({"addr": "127.0.0.1:7000", "resp_addr": "127.0.0.1:7000"}, {})
    load_config({"addr": "127.0.0.1:0", "resp_addr": "127.0.0.1:0"}, {})


def test_jwt_cross_checks(tmp_path: Path) -> None:
    pem = tmp_path / "k.pem"
    pem.write_text("placeholder")
    with pytest.raises(ConfigurationError, match="HS256 need --jwt-secret"):
        load_config({"jwt_public_key": str(pem), "jwt_algorithms": "HS256,RS256"}, {})
    with pytest.raises(ConfigurationError, match="RS256 need --jwt-public-key"):
        load_config({"jwt_secret": "k" * 40, "jwt_algorithms": "RS256"}, {})
    with pytest.raises(ConfigurationError, match="not both"):
        load_config({"jwt_secret": "k" * 40, "jwt_secret_file": str(pem)}, {})
    c = load_config({"jwt_public_key": str(pem), "jwt_audience": "a, b,a"}, {})
    assert c.jwt_audience == ("a", "b")
    assert c.jwt_enabled
    assert c.auth_configured


def test_every_setting_has_flag_env_and_help() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    help_text = parser.format_help()
    for s in SETTINGS:
        assert s.flag in help_text
        assert s.env.startswith("EPISTEMIC_GRAPH_KVCACHE_")
        assert s.help
    # Every ServerLimits field is configurable.
    names = {s.name for s in SETTINGS}
    assert set(ServerLimits.__dataclass_fields__) <= names


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.8.9.10", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("example.com", False),
    ],
)
def test_loopback_detection(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback


def test_check_bind() -> None:
    public = Address("0.0.0.0", 0)
    with pytest.raises(ConfigurationError, match=r"refusing to listen on 0\.0\.0\.0:0 \(--addr\)"):
        check_bind(public, flag="--addr", tls=False, allow_insecure_bind=False)
    check_bind(public, flag="--addr", tls=True, allow_insecure_bind=False)
    check_bind(public, flag="--addr", tls=False, allow_insecure_bind=True)
    check_bind(Address("127.0.0.1", 0), flag="--addr", tls=False, allow_insecure_bind=False)


def test_docs_list_every_setting() -> None:
    docs = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    for s in SETTINGS:
        assert f"| `{s.flag}` | `{s.env}`" in docs, s.flag
        assert f"`{s.name}`" in docs, s.name

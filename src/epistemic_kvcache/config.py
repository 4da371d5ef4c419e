"""Server configuration: one frozen `ServerConfig`, loaded in one place.

How it works: every setting is one row of `SETTINGS` (name, parser, default, help). The
row gives the three spellings of the setting — flag `--some-name`, environment
`EPISTEMIC_GRAPH_KVCACHE_SOME_NAME`, TOML key `some_name` — and `load_config` resolves
each row with the precedence flag > environment > TOML file > default, parsing every
raw value with the row's parser so that a bad value fails the same way wherever it
came from: a `ConfigurationError` naming the setting, the value and where it was set.
The `ServerLimits` fields (server/context.py) become settings automatically, so a new
limit is configurable the moment it is added there.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import ipaddress
import math
import os
import re
import shutil
import ssl
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.shared import (
    DEFAULT_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_RESP_PORT,
    GiB,
    KiB,
    MiB,
    ServerLimits,
    TiB,
    is_loopback_host,
)

ENV_PREFIX = "EPISTEMIC_GRAPH_KVCACHE_"
"""Every server setting `some_name` is also read from `EPISTEMIC_GRAPH_KVCACHE_SOME_NAME`."""

PERSIST_DIR_ENV_ALIAS = "GRAPH_SERVICE_PERSIST_DIR"
"""The persist dir name the user's deployments already set (DESIGN.md §1)."""

CONFIG_FILE_ENV = ENV_PREFIX + "CONFIG"

CLIENT_ENV_PREFIX = ENV_PREFIX + "CLIENT_"
"""Client-only variables (`EPISTEMIC_GRAPH_KVCACHE_CLIENT_*`): the server never reads them."""

CLIENT_ENV_NAMES = frozenset(
    {
        ENV_PREFIX + "URL",
        # Deprecated client names (still read by the client, with a warning); no server
        # setting has them.
        ENV_PREFIX + "CONNECT_TIMEOUT_S",
        ENV_PREFIX + "READ_TIMEOUT_S",
    }
)
"""Variables under the server's prefix that belong to the client: ignored without a warning.
`EPISTEMIC_GRAPH_KVCACHE_ADDR` and `_TOKEN` are read by both on purpose (the address the
server listens on / the client connects to; a token the server accepts / the client sends)."""

DEFAULT_TENANT = "default"
"""Tenant of `--token` tokens, of one-column token-file lines and of the generated token."""

JWT_ALGORITHMS = (
    "HS256",
    "HS384",
    "HS512",
    "RS256",
    "RS384",
    "RS512",
    "PS256",
    "PS384",
    "PS512",
    "ES256",
    "ES256K",
    "ES384",
    "ES512",
    "EdDSA",
)
"""Algorithms `--jwt-algorithms` may name (PyJWT's signing algorithms; never `none`)."""

HMAC_MIN_SECRET_BYTES = {"HS256": 32, "HS384": 48, "HS512": 64}
"""RFC 7518 §3.2: an HMAC key must be at least as long as the hash output."""


class Address(NamedTuple):
    """A listen address. `str()` gives `host:port` (`[v6]:port` for IPv6 literals)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        """True for `localhost` and loopback IP literals; any other name is not loopback."""
        return is_loopback_host(self.host)


DEFAULT_ADDR = Address(DEFAULT_HOST, DEFAULT_HTTP_PORT)
DEFAULT_RESP_ADDR = Address(DEFAULT_HOST, DEFAULT_RESP_PORT)


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `epistemic-kvcache serve` needs. Build it with `load_config`.

    Secrets (`tokens`, `jwt_secret`) are left out of `repr`.
    """

    addr: Address = DEFAULT_ADDR
    resp_addr: Address | None = DEFAULT_RESP_ADDR
    """`None` when the RESP listener is `off`."""
    backend: str = "durable"
    persist_dir: Path = Path("kvcache-data")
    epoch_dir: Path | None = None
    """The epoch registry (shareable between servers); `None`: `<persist_dir>/epochs`."""
    tokens: tuple[str, ...] = field(default=(), repr=False)
    token_file: Path | None = None
    generate_token: bool = True
    jwt_secret: str | None = field(default=None, repr=False)
    jwt_secret_file: Path | None = None
    jwt_public_key: Path | None = None
    jwt_jwks: Path | None = None
    jwt_algorithms: tuple[str, ...] = ()
    """Empty: derived from the configured keys (HS256 for a secret, the key's own type)."""
    jwt_issuer: str | None = None
    jwt_audience: tuple[str, ...] = ()
    jwt_tenant_claim: str = "tenant"
    jwt_leeway_s: float = 0.0
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    allow_insecure_bind: bool = False
    hot_capacity_bytes: int = 1 * GiB
    warm_capacity_bytes: int = 1 * GiB
    cold_capacity_bytes: int = 100 * GiB
    dedup_scope: str = "namespace"
    max_pinned_fraction: float = 0.5
    max_snapshots_per_tenant: int = 256
    max_keys_per_tenant: int = 0
    """Keys one tenant may hold (0: no limit)."""
    max_epoch_scopes_per_tenant: int = 10_000
    rebuild_index: bool = False
    """Rebuild the durable store's index from its log at start (when it is missing or
    damaged the server otherwise refuses to start)."""
    first_write_wins_tenants: tuple[str, ...] = ()
    """Tenants whose plain PUT of an existing key with other bytes is refused (conflict)
    instead of replacing it; `*` means every tenant."""
    metrics_tenants: tuple[str, ...] = ("default",)
    """Tenants allowed to read `/metrics` (empty: nobody)."""
    cluster_url: str | None = field(default=None, repr=False)
    """Cluster mode: `redis[s]://[user[:password]@]host:port[,host:port...]` of a Redis or
    Valkey Cluster; this server is then a stateless front-end over it (docs/cluster.md)."""
    cluster_tls_ca: Path | None = None
    cluster_password_file: Path | None = None
    cluster_wait_replicas: int = 0
    cluster_wait_timeout_s: float = 2.0
    cluster_retry_window_s: float = 10.0
    cluster_key_prefix: str = "kvc"
    cluster_block_ttl_s: float = 0.0
    cluster_scrub_interval_s: float = 3600.0
    limits: ServerLimits = field(default_factory=ServerLimits)
    store_threads: int = 32
    shutdown_timeout_s: float = 10.0
    log_level: str = "INFO"
    log_format: str = "text"
    """`text` (one line per record) or `json` (one JSON object per line)."""
    access_log: bool = False
    """One log line per answered request (logger `epistemic_kvcache.access`)."""
    stats_log_interval_s: float = 60.0
    retire_interval_s: float = 5.0
    config_file: Path | None = None
    warnings: tuple[str, ...] = field(default=(), compare=False)
    """Non-fatal findings of `load_config` (unknown env vars, ...), logged at start-up."""
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)
    """(setting name, where its value came from) for every setting, as `load_config`
    resolved it: `default`, `flag --x`, `env NAME` or `file PATH` (see
    `effective_settings`)."""

    @property
    def max_block_bytes(self) -> int:
        """Largest block accepted (the store and the listeners share it)."""
        return self.limits.max_block_bytes

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert is not None

    @property
    def jwt_enabled(self) -> bool:
        return bool(self.jwt_secret or self.jwt_secret_file or self.jwt_public_key or self.jwt_jwks)

    @property
    def auth_configured(self) -> bool:
        """Whether any credential source is configured (else the first-run token applies)."""
        return bool(self.tokens or self.token_file or self.jwt_enabled)

    def store_options(self) -> dict[str, Any]:
        """Keyword arguments for `SharedKvIndex` / `SharedKvStoreBackend`."""
        return {
            "hot_capacity_bytes": self.hot_capacity_bytes,
            "warm_capacity_bytes": self.warm_capacity_bytes,
            "cold_capacity_bytes": self.cold_capacity_bytes,
            "max_block_bytes": self.max_block_bytes,
            "dedup_scope": self.dedup_scope,
            "max_pinned_fraction": self.max_pinned_fraction,
            "max_snapshots_per_tenant": self.max_snapshots_per_tenant,
            "max_keys_per_tenant": self.max_keys_per_tenant,
            "max_epoch_scopes_per_tenant": self.max_epoch_scopes_per_tenant,
            **self._first_write_wins_option(),
        }

    @property
    def cluster_mode(self) -> bool:
        """Whether the store is a Redis/Valkey Cluster (`cluster_url` is set)."""
        return self.cluster_url is not None

    def cluster_options(self) -> dict[str, Any]:
        """Keyword arguments only the cluster backend takes (besides the URL)."""
        return {
            "tls_ca": self.cluster_tls_ca,
            "password_file": self.cluster_password_file,
            "wait_replicas": self.cluster_wait_replicas,
            "wait_timeout_s": self.cluster_wait_timeout_s,
            "retry_window_s": self.cluster_retry_window_s,
            "key_prefix": self.cluster_key_prefix,
            "block_ttl_s": self.cluster_block_ttl_s,
            "scrub_interval_s": self.cluster_scrub_interval_s,
        }

    def durable_options(self) -> dict[str, Any]:
        """Keyword arguments only the durable backend takes."""
        return {
            "rebuild_index": self.rebuild_index,
            "shutdown_timeout_s": self.shutdown_timeout_s,
        }

    def _first_write_wins_option(self) -> dict[str, bool | frozenset[str]]:
        tenants = self.first_write_wins_tenants
        if "*" in tenants:
            return {"first_write_wins": True}
        return {"first_write_wins": frozenset(tenants) if tenants else False}


# -- parsers: (setting name, raw value) -> value; raise ConfigurationError ----------------


class _Invalid(Exception):
    """Internal: a parser rejects a value; `load_config` adds name, value and source."""

    def __init__(self, expected: str, *, show_value: bool = True) -> None:
        super().__init__(expected)
        self.expected = expected
        self.show_value = show_value


_SIZE_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": KiB,
    "ki": KiB,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": MiB,
    "mi": MiB,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": GiB,
    "gi": GiB,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": TiB,
    "ti": TiB,
}


def parse_size(raw: object) -> int:
    """`4GiB`, `512MiB`, `1G` (SI: 10**9), `1.5GiB`, `1048576` -> bytes. Must be > 0."""
    expected = "a positive size like 4GiB"
    if isinstance(raw, bool):
        raise _Invalid(expected)
    if isinstance(raw, int):
        value = raw
    else:
        m = _SIZE_RE.match(str(raw))
        if m is None or m.group(2).lower() not in _SIZE_UNITS:
            raise _Invalid(expected)
        number = float(m.group(1).replace("_", ""))
        value = math.floor(number * _SIZE_UNITS[m.group(2).lower()])
    if value <= 0:
        raise _Invalid(expected)
    return value


def parse_size_or_zero(raw: object) -> int:
    """Like `parse_size`, but 0 is allowed (it turns a RAM tier off)."""
    if raw == 0 or (isinstance(raw, str) and raw.strip() in ("0", "0B", "0b")):
        return 0
    try:
        return parse_size(raw)
    except _Invalid:
        raise _Invalid("a size like 4GiB, or 0 to turn the tier off") from None


def _parse_int(raw: object, *, minimum: int, expected: str) -> int:
    if isinstance(raw, bool):
        raise _Invalid(expected)
    if isinstance(raw, int):
        value = raw
    else:
        try:
            value = int(str(raw).strip().replace("_", ""))
        except ValueError:
            raise _Invalid(expected) from None
    if value < minimum:
        raise _Invalid(expected)
    return value


def _parse_positive_int(raw: object) -> int:
    return _parse_int(raw, minimum=1, expected="a positive integer")


def _parse_nonneg_int(raw: object) -> int:
    return _parse_int(raw, minimum=0, expected="a non-negative integer")


def _parse_seconds(raw: object, *, allow_zero: bool) -> float:
    expected = "a number of seconds >= 0" if allow_zero else "a number of seconds > 0"
    if isinstance(raw, bool):
        raise _Invalid(expected)
    try:
        value = float(raw) if isinstance(raw, int | float) else float(str(raw).strip())
    except ValueError:
        raise _Invalid(expected) from None
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise _Invalid(expected)
    return value


def _parse_fraction(raw: object) -> float:
    expected = "a fraction in (0, 1], e.g. 0.5"
    if isinstance(raw, bool):
        raise _Invalid(expected)
    try:
        value = float(raw) if isinstance(raw, int | float) else float(str(raw).strip())
    except ValueError:
        raise _Invalid(expected) from None
    if not math.isfinite(value) or not 0 < value <= 1:
        raise _Invalid(expected)
    return value


def _nonneg_seconds(raw: object) -> float:
    return _parse_seconds(raw, allow_zero=True)


def _pos_seconds(raw: object) -> float:
    return _parse_seconds(raw, allow_zero=False)


def parse_address(raw: object) -> Address:
    """`host:port` or `[v6]:port`; port 0 asks the OS for a free port."""
    expected = "host:port, e.g. 127.0.0.1:9130 or [::1]:9130"
    if not isinstance(raw, str):
        raise _Invalid(expected)
    text = raw.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise _Invalid(expected)
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _Invalid(expected) from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host or ":" in host:
            raise _Invalid(expected)
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise _Invalid(expected + ", port 0..65535")
    if not re.fullmatch(r"[A-Za-z0-9._:%-]+", host):
        raise _Invalid(expected)
    return Address(host, int(port_text))


def _parse_address_or_off(raw: object) -> Address | None:
    if isinstance(raw, str) and raw.strip().lower() in ("off", "none", "disabled"):
        return None
    if raw is False:
        return None
    try:
        return parse_address(raw)
    except _Invalid:
        raise _Invalid("host:port (e.g. 127.0.0.1:6379) or 'off'") from None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(raw: object) -> bool:
    """true/false, 1/0, yes/no, on/off (case-insensitive); TOML booleans."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise _Invalid("a boolean (true/false, 1/0, yes/no, on/off)")


def _choice(*options: str) -> Callable[[object], str]:
    def parse(raw: object) -> str:
        text = str(raw).strip().lower() if isinstance(raw, str) else None
        if text not in options:
            raise _Invalid("one of " + ", ".join(options))
        return text

    return parse


def _parse_log_level(raw: object) -> str:
    levels = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    text = str(raw).strip().upper() if isinstance(raw, str) else ""
    if text == "WARN":
        text = "WARNING"
    if text not in levels:
        raise _Invalid("one of " + ", ".join(level.lower() for level in levels))
    return text


def _parse_path(raw: object) -> Path:
    if not isinstance(raw, str | Path) or not str(raw).strip():
        raise _Invalid("a file system path")
    return Path(str(raw).strip()).expanduser()


def _parse_optional_text(raw: object) -> str | None:
    if not isinstance(raw, str):
        raise _Invalid("a string")
    return raw.strip() or None


def _parse_cluster_url(raw: object) -> str | None:
    if not isinstance(raw, str):
        raise _Invalid("a redis:// or rediss:// URL", show_value=False)
    text = raw.strip()
    if not text:
        return None
    if not text.startswith(("redis://", "rediss://")):
        raise _Invalid("a redis://host:port[,host:port...] or rediss://... URL", show_value=False)
    return text


def _parse_key_prefix(raw: object) -> str:
    if not isinstance(raw, str) or not raw.strip() or any(c in raw.strip() for c in "{}: "):
        raise _Invalid("a word without braces, colons or spaces")
    return raw.strip()


def _parse_claim(raw: object) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise _Invalid("a claim name")
    return raw.strip()


def _parse_list(raw: object) -> tuple[str, ...]:
    """A comma-separated string, or a TOML array / repeated flag of strings."""
    items: list[object]
    if isinstance(raw, str):
        items = list(raw.split(","))
    elif isinstance(raw, list | tuple):
        items = []
        for item in raw:
            items.extend(item.split(",") if isinstance(item, str) else [item])
    else:
        raise _Invalid("a comma-separated list")
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise _Invalid("a comma-separated list of strings")
        if item.strip() and item.strip() not in out:
            out.append(item.strip())
    return tuple(out)


def _parse_algorithms(raw: object) -> tuple[str, ...]:
    algs = _parse_list(raw)
    canonical = {a.lower(): a for a in JWT_ALGORITHMS}
    out = []
    for alg in algs:
        if alg.lower() == "none":
            raise _Invalid("signing algorithms; 'none' is never accepted")
        if alg.lower() not in canonical:
            raise _Invalid("algorithms among " + ", ".join(JWT_ALGORITHMS))
        out.append(canonical[alg.lower()])
    return tuple(out)


def _parse_tokens(raw: object) -> tuple[str, ...]:
    """`--token` (repeatable) / TOML string or array / env: one token."""
    items = raw if isinstance(raw, list | tuple) else [raw]
    out: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise _Invalid("a non-empty token string", show_value=False)
        token = item.strip()
        if any(c.isspace() for c in token):
            raise _Invalid("a token without whitespace", show_value=False)
        if token not in out:
            out.append(token)
    return tuple(out)


def _parse_secret(raw: object) -> str | None:
    if not isinstance(raw, str):
        raise _Invalid("a string", show_value=False)
    return raw.strip() or None


# -- the settings table ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setting:
    """One configuration setting and its three spellings."""

    name: str
    parse: Callable[[object], Any]
    default: Any
    help: str
    metavar: str | None = None
    kind: str = "value"
    """`value` (one argument), `bool` (--x / --no-x), `append` (repeatable flag)."""
    secret: bool = False
    """Never echo the value in error messages."""
    extra_env: tuple[str, ...] = ()
    """Further environment names, read after the canonical one."""
    path_like: bool = False
    """Relative paths in the TOML file are resolved against the file's directory."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def env_names(self) -> tuple[str, ...]:
        return (self.env, *self.extra_env)


_D = ServerConfig()

_LIMIT_HELP = {
    "max_block_bytes": "largest block accepted (HTTP 413 / RESP error above it)",
    "receive_prefault_bytes": "receive memory for large blocks faulted in ahead of need "
    "on a helper thread (0: off)",
    "max_header_bytes": "total HTTP request head size",
    "max_headers": "HTTP header count per request",
    "request_timeout_s": "deadline to receive one whole request once it started",
    "idle_timeout_s": "idle keep-alive connections are closed after this long",
    "auth_timeout_s": "connections not authenticated this long after opening are closed",
    "max_connections": "open connections per listener",
    "max_batch_keys": "keys per batch request",
    "max_batch_bytes": "total block bytes per batch request",
    "max_inflight_body_bytes": "every byte buffered for clients (bodies, bulks, queued "
    "commands, cold-read and batch answers), server-wide (over it: HTTP 503 overloaded / "
    "RESP -ERR server busy)",
    "max_tenant_inflight_bytes": "one tenant's share of max_inflight_body_bytes "
    "(over it: HTTP 429 tenant_busy / RESP -ERR)",
    "max_unauthenticated_connections": "connections per listener not authenticated yet "
    "(full: the oldest is closed)",
    "max_unauthenticated_connections_per_peer": "unauthenticated connections per client "
    "address (over it: its oldest is closed)",
    "max_connections_per_peer": "connections per client address and listener",
    "max_connections_per_tenant": (
        "authenticated connections per tenant and listener (at most half of max_connections)"
    ),
    "subscriber_idle_timeout_s": "RESP subscribers sending nothing this long are closed",
    "client_output_buffer_limit_bytes": "unread replies one connection may hold; over it "
    "the client is disconnected",
    "resp_max_query_buffer_bytes": "bytes of not-yet-run RESP commands one connection may "
    "buffer (large bulks aside); over it the client is disconnected",
    "resp_unauthenticated_max_buffer_bytes": "bytes a RESP connection may send ahead before "
    "AUTH (reading pauses above it)",
    "resp_unauthenticated_max_args": "RESP arguments per command before AUTH",
    "resp_unauthenticated_max_bulk_bytes": "RESP bulk string size before AUTH",
    "resp_max_args": "RESP arguments per command",
}


_LIMITS_ZERO_OFF = frozenset({"receive_prefault_bytes"})
"""Limits whose 0 means "off" (the others must be positive)."""


def _limit_settings() -> list[Setting]:
    out = []
    defaults = ServerLimits()
    for f in dataclasses.fields(ServerLimits):
        if f.name in _LIMITS_ZERO_OFF:
            parse: Callable[[object], Any] = parse_size_or_zero
            metavar = "SIZE"
        elif f.name.endswith("_bytes"):
            parse = parse_size
            metavar = "SIZE"
        elif f.name.endswith("_s"):
            parse, metavar = _pos_seconds, "SECONDS"
        else:
            parse, metavar = _parse_positive_int, "N"
        help_text = _LIMIT_HELP.get(f.name, f.name.replace("_", " "))
        out.append(Setting(f.name, parse, getattr(defaults, f.name), help_text, metavar))
    return out


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "addr", parse_address, _D.addr, "HTTP listen address (port 0: any free port)", "HOST:PORT"
    ),
    Setting(
        "resp_addr",
        _parse_address_or_off,
        _D.resp_addr,
        "Redis RESP listen address, or 'off'",
        "HOST:PORT|off",
    ),
    Setting(
        "backend",
        _choice("durable", "memory"),
        _D.backend,
        "durable (disk-backed) or memory (in-process, ephemeral)",
        "durable|memory",
    ),
    Setting(
        "persist_dir",
        _parse_path,
        _D.persist_dir,
        "where the durable store (and a generated token) live",
        "DIR",
        extra_env=(PERSIST_DIR_ENV_ALIAS,),
        path_like=True,
    ),
    Setting(
        "epoch_dir",
        _parse_path,
        None,
        "epoch registry, shareable by servers on one host (default: <persist-dir>/epochs)",
        "DIR",
        path_like=True,
    ),
    Setting(
        "token",
        _parse_tokens,
        _D.tokens,
        "accepted bearer token for tenant 'default' (repeatable; prefer --token-file)",
        "TOKEN",
        kind="append",
        secret=True,
    ),
    Setting(
        "token_file",
        _parse_path,
        None,
        "file of 'token [tenant]' lines (see docs/security.md)",
        "FILE",
        path_like=True,
    ),
    Setting(
        "generate_token",
        parse_bool,
        _D.generate_token,
        "with no credentials configured, create/reuse <persist-dir>/token",
        kind="bool",
    ),
    Setting(
        "jwt_secret",
        _parse_secret,
        None,
        "HMAC secret for HS256/384/512 JWTs (>= 32 bytes; prefer --jwt-secret-file)",
        "SECRET",
        secret=True,
    ),
    Setting(
        "jwt_secret_file",
        _parse_path,
        None,
        "file holding the HMAC secret",
        "FILE",
        path_like=True,
    ),
    Setting(
        "jwt_public_key",
        _parse_path,
        None,
        "PEM public key (or certificate) verifying RS*/PS*/ES*/EdDSA JWTs",
        "FILE",
        path_like=True,
    ),
    Setting(
        "jwt_jwks",
        _parse_path,
        None,
        "JWKS file of public keys, selected by the token's kid",
        "FILE",
        path_like=True,
    ),
    Setting(
        "jwt_algorithms",
        _parse_algorithms,
        _D.jwt_algorithms,
        "accepted JWT algorithms, comma-separated (default: from the keys)",
        "ALGS",
    ),
    Setting("jwt_issuer", _parse_optional_text, None, "required JWT iss", "ISS"),
    Setting(
        "jwt_audience",
        _parse_list,
        _D.jwt_audience,
        "accepted JWT aud values, comma-separated (one must match)",
        "AUD",
    ),
    Setting(
        "jwt_tenant_claim",
        _parse_claim,
        _D.jwt_tenant_claim,
        "JWT claim naming the tenant (falls back to sub)",
        "CLAIM",
    ),
    Setting(
        "jwt_leeway_s",
        _nonneg_seconds,
        _D.jwt_leeway_s,
        "clock skew allowed on exp/nbf/iat",
        "SECONDS",
    ),
    Setting("tls_cert", _parse_path, None, "TLS certificate chain (PEM)", "FILE", path_like=True),
    Setting("tls_key", _parse_path, None, "TLS private key (PEM)", "FILE", path_like=True),
    Setting(
        "tls_client_ca",
        _parse_path,
        None,
        "CA bundle for client certificates: turns on mTLS",
        "FILE",
        path_like=True,
    ),
    Setting(
        "allow_insecure_bind",
        parse_bool,
        _D.allow_insecure_bind,
        "allow a non-loopback listener without TLS",
        kind="bool",
    ),
    Setting(
        "hot_capacity_bytes", parse_size_or_zero, _D.hot_capacity_bytes, "hot tier (RAM)", "SIZE"
    ),
    Setting(
        "warm_capacity_bytes",
        parse_size_or_zero,
        _D.warm_capacity_bytes,
        "warm tier (RAM, compressed)",
        "SIZE",
    ),
    Setting(
        "cold_capacity_bytes",
        parse_size,
        _D.cold_capacity_bytes,
        "cold tier (disk, durable backend)",
        "SIZE",
    ),
    Setting(
        "dedup_scope",
        _choice("namespace", "global"),
        _D.dedup_scope,
        "share identical bytes within a namespace (default) or globally",
        "namespace|global",
    ),
    Setting(
        "max_pinned_fraction",
        _parse_fraction,
        _D.max_pinned_fraction,
        "share of the capacity one tenant may pin (pins and snapshots; cold tier, or RAM "
        "for the memory backend)",
        "FRACTION",
    ),
    Setting(
        "max_snapshots_per_tenant",
        _parse_positive_int,
        _D.max_snapshots_per_tenant,
        "live snapshots one tenant may hold",
        "N",
    ),
    Setting(
        "max_keys_per_tenant",
        _parse_nonneg_int,
        _D.max_keys_per_tenant,
        "keys one tenant may hold (0: no limit); a tenant at its limit gets its own error",
        "N",
    ),
    Setting(
        "max_epoch_scopes_per_tenant",
        _parse_positive_int,
        _D.max_epoch_scopes_per_tenant,
        "epoch scopes one tenant may register (scopes without live entries are pruned first)",
        "N",
    ),
    Setting(
        "rebuild_index",
        parse_bool,
        _D.rebuild_index,
        "rebuild the durable store's index from its log at start (instead of refusing to "
        "start when the index is missing or damaged)",
        kind="bool",
    ),
    Setting(
        "first_write_wins_tenants",
        _parse_list,
        _D.first_write_wins_tenants,
        "tenants for which a PUT of an existing key with other bytes is refused (conflict) "
        "instead of replacing it, comma-separated; * for every tenant",
        "TENANTS",
    ),
    Setting(
        "metrics_tenants",
        _parse_list,
        _D.metrics_tenants,
        "tenants allowed to read /metrics (store-wide totals), comma-separated; empty: nobody",
        "TENANTS",
    ),
    Setting(
        "cluster_url",
        _parse_cluster_url,
        None,
        "cluster mode: redis[s]://[user[:password]@]host:port[,host:port...] of a Redis/Valkey "
        "Cluster shared by every front-end (see docs/cluster.md)",
        "URL",
        secret=True,
    ),
    Setting(
        "cluster_tls_ca",
        _parse_path,
        None,
        "CA bundle verifying the cluster's TLS certificates (rediss://)",
        "FILE",
        path_like=True,
    ),
    Setting(
        "cluster_password_file",
        _parse_path,
        None,
        "file whose first line is the cluster password (replaces one in the URL)",
        "FILE",
        path_like=True,
    ),
    Setting(
        "cluster_wait_replicas",
        _parse_nonneg_int,
        _D.cluster_wait_replicas,
        "acknowledge a write once this many replicas have it (WAIT); 0: once the master has it",
        "N",
    ),
    Setting(
        "cluster_wait_timeout_s",
        _pos_seconds,
        _D.cluster_wait_timeout_s,
        "how long a write waits for its replicas before it fails (retryably)",
        "SECONDS",
    ),
    Setting(
        "cluster_retry_window_s",
        _pos_seconds,
        _D.cluster_retry_window_s,
        "how long an operation retries through a failover or resharding before it fails; "
        "longer than the cluster's failover time hides failovers from clients",
        "SECONDS",
    ),
    Setting(
        "cluster_key_prefix",
        _parse_key_prefix,
        _D.cluster_key_prefix,
        "prefix of every key this deployment writes in the cluster (several deployments may "
        "share one cluster under different prefixes)",
        "WORD",
    ),
    Setting(
        "cluster_block_ttl_s",
        _nonneg_seconds,
        _D.cluster_block_ttl_s,
        "blocks expire this long after their last new reference unless pinned; with a "
        "volatile-* maxmemory-policy the cluster evicts only blocks (0: no expiry)",
        "SECONDS",
    ),
    Setting(
        "cluster_scrub_interval_s",
        _nonneg_seconds,
        _D.cluster_scrub_interval_s,
        "recount block references and reclaim what crashes leaked this often (one front-end "
        "at a time; 0: never)",
        "SECONDS",
    ),
    *_limit_settings(),
    Setting(
        "store_threads",
        _parse_positive_int,
        _D.store_threads,
        "threads running blocking store calls",
        "N",
    ),
    Setting(
        "shutdown_timeout_s",
        _pos_seconds,
        _D.shutdown_timeout_s,
        "on SIGTERM, how long in-flight requests may take to finish",
        "SECONDS",
    ),
    Setting("log_level", _parse_log_level, _D.log_level, "debug, info, warning, error", "LEVEL"),
    Setting(
        "log_format",
        _choice("text", "json"),
        _D.log_format,
        "text, or json (one JSON object per line)",
        "text|json",
    ),
    Setting(
        "access_log",
        parse_bool,
        _D.access_log,
        "log one line per answered request (logger epistemic_kvcache.access)",
        kind="bool",
    ),
    Setting(
        "stats_log_interval_s",
        _nonneg_seconds,
        _D.stats_log_interval_s,
        "log hit rate, dedup and tier occupancy this often (0: never)",
        "SECONDS",
    ),
    Setting(
        "retire_interval_s",
        _nonneg_seconds,
        _D.retire_interval_s,
        "sweep stale epoch entries and expired snapshots this often, bounded per sweep (0: never)",
        "SECONDS",
    ),
)

SETTINGS_BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}
_LIMIT_NAMES = frozenset(f.name for f in dataclasses.fields(ServerLimits))
_RENAMED = {"token": "tokens"}
"""Setting name -> ServerConfig field, where they differ."""


def add_arguments(
    parser: argparse.ArgumentParser, only: Callable[[str], bool] | None = None
) -> None:
    """Add `--config` and every setting's flag to `parser` (with `only`: the settings
    whose name it accepts; the others still come from the environment and the file).

    Unset flags stay absent from the namespace (`argparse.SUPPRESS`), so `load_config`
    can tell "not given" from "given the default". Values stay strings; `load_config`
    parses them.
    """
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS,
        help=f"TOML file of settings (env {CONFIG_FILE_ENV})",
    )
    for s in SETTINGS:
        if only is not None and not only(s.name):
            continue
        default_text = _format_default(s)
        help_text = f"{s.help} (env {s.env}{default_text})"
        if s.kind == "bool":
            parser.add_argument(
                s.flag,
                dest=s.name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        elif s.kind == "append":
            parser.add_argument(
                s.flag,
                dest=s.name,
                action="append",
                default=argparse.SUPPRESS,
                metavar=s.metavar,
                help=help_text,
            )
        else:
            parser.add_argument(
                s.flag, dest=s.name, default=argparse.SUPPRESS, metavar=s.metavar, help=help_text
            )


def _format_default(s: Setting) -> str:
    if s.secret or s.default in (None, ()):
        return ""
    value = s.default
    if isinstance(value, Address):
        value = str(value)
    elif isinstance(value, tuple):
        value = ",".join(value)
    if isinstance(value, bool):
        value = "true" if value else "false"
    if isinstance(value, int) and s.name.endswith("_bytes"):
        value = format_size(value)
    return f"; default {value}".replace("%", "%%")


def format_size(n: int) -> str:
    """Bytes as the largest exact binary unit: 1073741824 -> `1GiB`."""
    for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def load_config(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    config_file: str | Path | None = None,
) -> ServerConfig:
    """Resolve every setting: flag > environment > TOML file > default, then validate.

    `cli` maps setting names to raw flag values (`vars()` of a parser built with
    `add_arguments`; a `config` entry names the TOML file). `env` defaults to
    `os.environ`. Raises `ConfigurationError` naming the setting and the value.
    """
    cli = dict(cli or {})
    env = os.environ if env is None else env
    warnings: list[str] = []

    file_source = cli.pop("config", None) or config_file or env.get(CONFIG_FILE_ENV) or None
    toml_values: dict[str, Any] = {}
    toml_path: Path | None = None
    if file_source is not None:
        toml_path = Path(str(file_source)).expanduser()
        toml_values = _read_toml(toml_path)

    unknown_cli = set(cli) - set(SETTINGS_BY_NAME)
    if unknown_cli:
        raise ConfigurationError(f"unknown settings: {', '.join(sorted(unknown_cli))}")

    known_env = {name for s in SETTINGS for name in s.env_names} | {CONFIG_FILE_ENV}
    all_names = sorted(s.env for s in SETTINGS)
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in known_env:
            continue
        if name.startswith(CLIENT_ENV_PREFIX) or name in CLIENT_ENV_NAMES:
            continue
        hint = difflib.get_close_matches(name, all_names, n=1)
        warnings.append(
            f"unknown environment variable {name} ignored"
            + (f" (did you mean {hint[0]}?)" if hint else "")
        )

    values: dict[str, Any] = {}
    explicit: set[str] = set()
    origins: list[tuple[str, str]] = []
    overridden: dict[str, str] = {}
    for s in SETTINGS:
        raw: Any
        if s.name in cli:
            raw, source, from_toml = cli[s.name], s.flag, False
            origins.append((s.name, f"flag {s.flag}"))
        elif (env_name := next((n for n in s.env_names if env.get(n, "") != ""), None)) is not None:
            raw, source, from_toml = env[env_name], f"environment {env_name}", False
            origins.append((s.name, f"env {env_name}"))
        elif s.name in toml_values:
            raw, source, from_toml = toml_values[s.name], f"{toml_path} key {s.name}", True
            origins.append((s.name, f"file {toml_path}"))
        else:
            values[s.name] = s.default
            origins.append((s.name, "default"))
            continue
        try:
            value = s.parse(raw)
        except _Invalid as exc:
            shown = f"got {raw!r}" if exc.show_value else "value not shown"
            raise ConfigurationError(
                f"invalid {s.name}: expected {exc.expected} ({shown}); set by {source}"
            ) from None
        if s.path_like and from_toml and toml_path is not None and not value.is_absolute():
            value = toml_path.parent / value
        values[s.name] = value
        explicit.add(s.name)
        if not from_toml and toml_path is not None and s.name in toml_values:
            shadowed = _shadowed_toml_value(s, toml_values[s.name], toml_path, value)
            if shadowed is not None:
                shown = "" if s.secret else f" ({shadowed} -> {_show(value)})"
                overridden[s.name] = f"{toml_path} key {s.name} is overridden by {source}{shown}"
                warnings.append(
                    f"{overridden[s.name]}: the file's value is not used "
                    "(precedence: flag > environment > config file)"
                )

    limits = ServerLimits(**{name: values.pop(name) for name in _LIMIT_NAMES})
    fields = {_RENAMED.get(k, k): v for k, v in values.items()}
    config = ServerConfig(
        **fields,
        limits=limits,
        config_file=toml_path,
        warnings=tuple(warnings),
        sources=tuple(origins),
    )
    try:
        _validate(config)
    except ConfigurationError as exc:
        # "invalid token_file: file not found" names the setting; where a flag or the
        # environment overrode the config file's value, say so: that is the likely cause.
        named = re.match(r"invalid (\w+)", str(exc))
        note = overridden.get(named.group(1)) if named else None
        if note is None:
            raise
        raise ConfigurationError(f"{exc} ({note})") from None
    warnings.extend(_resource_warnings(config, explicit))
    return dataclasses.replace(config, warnings=tuple(warnings))


def setting_value(config: ServerConfig, name: str) -> Any:
    """The effective value of setting `name` in `config` (limits included)."""
    if name in _LIMIT_NAMES:
        return getattr(config.limits, name)
    return getattr(config, _RENAMED.get(name, name))


def format_setting_value(s: Setting, value: Any) -> str:
    """A value as an operator would write it back (sizes in binary units, booleans as
    true/false, lists comma-separated); secrets as `(hidden)` or empty when unset."""
    if s.secret:
        return "(hidden)" if value not in (None, ()) else ""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Address):
        return str(value)
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    if isinstance(value, int) and s.metavar == "SIZE":
        return format_size(value)
    if isinstance(value, str) and s.name == "log_level":
        return value.lower()
    return str(value)


def effective_settings(config: ServerConfig) -> list[tuple[str, str, str]]:
    """(name, value, source) for every setting, in the order of `SETTINGS`: what
    `epistemic-kvcache config show` and RESP `CONFIG GET` print. Secrets never appear."""
    sources = dict(config.sources)
    return [
        (
            s.name,
            format_setting_value(s, setting_value(config, s.name)),
            sources.get(s.name, "default"),
        )
        for s in SETTINGS
    ]


def _show(value: object) -> str:
    if isinstance(value, Address | Path):
        return f"'{value}'"
    return repr(value)


def _shadowed_toml_value(s: Setting, raw: object, toml_path: Path, used: object) -> str | None:
    """How the TOML file's value of `s` reads when a flag or the environment gave it
    another one (None: the same value, nothing is lost)."""
    try:
        value = s.parse(raw)
    except _Invalid:
        return repr(raw)  # invalid in the file, unused: still a value nobody gets
    if s.path_like and isinstance(value, Path) and not value.is_absolute():
        value = toml_path.parent / value
    return None if value == used else _show(value)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigurationError(f"invalid config: file not found (got '{path}')") from None
    except OSError as exc:
        raise ConfigurationError(f"invalid config: cannot read '{path}': {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"invalid config: '{path}' is not valid TOML: {exc}") from None
    unknown = [key for key in data if key not in SETTINGS_BY_NAME]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, list(SETTINGS_BY_NAME), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigurationError(f"invalid config: unknown keys in '{path}': {', '.join(hints)}")
    return data


def _validate(c: ServerConfig) -> None:
    """Cross-setting checks; each names the settings involved."""

    def fail(name: str, message: str) -> None:
        raise ConfigurationError(f"invalid {name}: {message}")

    if c.resp_addr is not None and c.resp_addr.port != 0 and c.resp_addr == c.addr:
        fail("resp_addr", f"same address as addr (got '{c.resp_addr}')")
    for name in ("persist_dir", "epoch_dir"):
        path = getattr(c, name)
        if path is not None and path.exists() and not path.is_dir():
            fail(name, f"not a directory (got '{path}')")

    # TLS
    if (c.tls_cert is None) != (c.tls_key is None):
        missing = "tls_key" if c.tls_key is None else "tls_cert"
        fail(missing, "--tls-cert and --tls-key go together (one of them is missing)")
    if c.tls_client_ca is not None and c.tls_cert is None:
        fail("tls_client_ca", "mTLS needs --tls-cert and --tls-key as well")

    if c.cluster_url is None:
        for name in ("cluster_tls_ca", "cluster_password_file"):
            if getattr(c, name) is not None:
                fail(name, "only used in cluster mode (set --cluster-url)")
    elif c.cluster_tls_ca is not None and not c.cluster_url.startswith("rediss://"):
        fail("cluster_tls_ca", "the cluster URL is redis:// (use rediss:// for TLS)")
    for name in (
        "cluster_tls_ca",
        "cluster_password_file",
        "token_file",
        "jwt_secret_file",
        "jwt_public_key",
        "jwt_jwks",
        "tls_cert",
        "tls_key",
        "tls_client_ca",
    ):
        path = getattr(c, name)
        if path is not None and not path.is_file():
            fail(name, f"file not found (got '{path}')")
        if path is not None and not os.access(path, os.R_OK):
            fail(name, f"file not readable by this user (got '{path}')")
    if c.tls_cert is not None and c.tls_key is not None:
        _check_tls_files(c.tls_cert, c.tls_key, c.tls_client_ca)

    # JWT
    if c.jwt_secret is not None and c.jwt_secret_file is not None:
        fail("jwt_secret", "give --jwt-secret or --jwt-secret-file, not both")
    has_hmac_key = c.jwt_secret is not None or c.jwt_secret_file is not None
    has_public_key = c.jwt_public_key is not None or c.jwt_jwks is not None
    if not c.jwt_enabled:
        for name in ("jwt_algorithms", "jwt_issuer", "jwt_audience"):
            if getattr(c, name):
                fail(
                    name, "no JWT key configured (set --jwt-secret, --jwt-public-key or --jwt-jwks)"
                )
    hmac_algs = [a for a in c.jwt_algorithms if a.startswith("HS")]
    public_algs = [a for a in c.jwt_algorithms if not a.startswith("HS")]
    if hmac_algs and not has_hmac_key:
        fail("jwt_algorithms", f"{', '.join(hmac_algs)} need --jwt-secret")
    if public_algs and not has_public_key:
        fail("jwt_algorithms", f"{', '.join(public_algs)} need --jwt-public-key or --jwt-jwks")
    if c.jwt_algorithms and has_hmac_key and not hmac_algs:
        fail("jwt_secret", "set, but --jwt-algorithms names no HS256/HS384/HS512")
    if c.jwt_algorithms and has_public_key and not public_algs:
        fail("jwt_algorithms", "no asymmetric algorithm for --jwt-public-key / --jwt-jwks")
    if c.jwt_secret is not None:
        check_hmac_secret(c.jwt_secret.encode("utf-8"), c.jwt_algorithms or ("HS256",))

    lim = c.limits
    for name in ("max_block_bytes", "max_batch_bytes"):
        if getattr(lim, name) > lim.max_inflight_body_bytes:
            fail(
                "max_inflight_body_bytes",
                f"expected at least {name} ({format_size(getattr(lim, name))}), "
                f"got {format_size(lim.max_inflight_body_bytes)}",
            )
        share = min(lim.max_tenant_inflight_bytes, lim.max_inflight_body_bytes)
        if getattr(lim, name) > share:
            fail(
                "max_tenant_inflight_bytes",
                f"expected at least {name} ({format_size(getattr(lim, name))}), "
                f"got {format_size(lim.max_tenant_inflight_bytes)}",
            )

    if c.store_threads > 1024:
        fail("store_threads", f"expected at most 1024 (got {c.store_threads})")


def check_persist_dir(c: ServerConfig) -> None:
    """`serve` only: an existing persist_dir (or epoch_dir) the server cannot write is a
    configuration error at start, not a PermissionError from deep inside the store."""
    if c.backend != "durable" or c.cluster_mode:
        return
    for name in ("persist_dir", "epoch_dir"):
        path = getattr(c, name)
        if path is not None and path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
            raise ConfigurationError(
                f"invalid {name}: not writable by this user (uid {os.getuid()}) or on a "
                f"read-only file system (got '{path}')"
            )


def check_listeners(c: ServerConfig) -> None:
    """The bind rule for both listeners (`serve` runs it before creating any file)."""
    check_bind(c.addr, flag="--addr", tls=c.tls_enabled, allow_insecure_bind=c.allow_insecure_bind)
    if c.resp_addr is not None:
        check_bind(
            c.resp_addr,
            flag="--resp-addr",
            tls=c.tls_enabled,
            allow_insecure_bind=c.allow_insecure_bind,
        )


def check_bind(addr: Address, *, flag: str, tls: bool, allow_insecure_bind: bool) -> None:
    """Refuse a plaintext listener on a non-loopback address unless explicitly allowed."""
    if tls or allow_insecure_bind or addr.is_loopback:
        return
    raise ConfigurationError(
        f"invalid {flag.removeprefix('--').replace('-', '_')}: refusing to listen on {addr} "
        f"({flag}) without TLS; set --tls-cert and --tls-key, bind a loopback address, "
        "or pass --allow-insecure-bind"
    )


_PEM_CERT = b"-----BEGIN CERTIFICATE-----"
_PEM_KEY = re.compile(rb"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----")


def _check_tls_files(cert: Path, key: Path, client_ca: Path | None) -> None:
    """Load the certificate and key the way the listeners will; name the setting at fault."""
    cert_pem, key_pem = cert.read_bytes(), key.read_bytes()
    cert_has_cert, key_has_key = _PEM_CERT in cert_pem, bool(_PEM_KEY.search(key_pem))
    if not cert_has_cert and not key_has_key and _PEM_KEY.search(cert_pem) and _PEM_CERT in key_pem:
        raise ConfigurationError(
            f"invalid tls_cert/tls_key: swapped: tls_cert '{cert}' holds a private key and "
            f"tls_key '{key}' a certificate"
        )
    if not cert_has_cert:
        raise ConfigurationError(f"invalid tls_cert: no PEM certificate in '{cert}'")
    if not key_has_key and not _PEM_KEY.search(cert_pem):
        raise ConfigurationError(f"invalid tls_key: no PEM private key in '{key}'")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except ssl.SSLError as exc:
        why = (
            "the key does not belong to the certificate"
            if "KEY_VALUES_MISMATCH" in str(exc)
            else f"cannot be loaded ({exc.reason or exc})"
        )
        raise ConfigurationError(
            f"invalid tls_key: '{key}' with tls_cert '{cert}': {why}"
        ) from None
    if client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=str(client_ca))
        except ssl.SSLError as exc:
            raise ConfigurationError(
                f"invalid tls_client_ca: no usable CA certificate in '{client_ca}' "
                f"({exc.reason or exc})"
            ) from None


def _memory_limit_bytes() -> int | None:
    """RAM this process may use: the cgroup limit when there is one, else physical RAM."""
    try:
        raw = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if raw.isdigit():
            return int(raw)
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        return None


def _disk_size_bytes(path: Path) -> int | None:
    """Size of the file system that holds `path` (or its nearest existing parent)."""
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).total
    except OSError:
        return None


def _resource_warnings(c: ServerConfig, explicit: set[str]) -> list[str]:
    """Settings that are valid but cannot work as written on this machine."""
    out: list[str] = []
    lim = c.limits
    if lim.tenant_connection_cap < lim.max_connections_per_tenant:
        out.append(
            f"max_connections_per_tenant = {lim.max_connections_per_tenant} is clamped to "
            f"{lim.tenant_connection_cap}, half of max_connections = {lim.max_connections}: "
            "one tenant may hold at most half of a listener's connections (raise "
            "max_connections to let a tenant hold more)"
        )
    ram = _memory_limit_bytes()
    tiers = c.hot_capacity_bytes + c.warm_capacity_bytes
    if ram is not None and tiers > ram:
        out.append(
            f"hot_capacity_bytes + warm_capacity_bytes = {format_size(tiers)} exceed this "
            f"machine's memory ({format_size(ram)}): the tiers will never fill, the kernel "
            "will kill the server first"
        )
    if c.cluster_mode:
        pass  # the cluster holds the blocks: no disk tier here
    elif c.backend == "durable":
        disk = _disk_size_bytes(c.persist_dir)
        if disk is not None and c.cold_capacity_bytes > disk:
            out.append(
                f"cold_capacity_bytes = {format_size(c.cold_capacity_bytes)} exceeds the file "
                f"system of persist_dir '{c.persist_dir}' ({format_size(disk)}): writes will "
                "fail with disk full before the cold tier evicts"
            )
    elif "cold_capacity_bytes" in explicit:
        out.append("cold_capacity_bytes is ignored with backend 'memory' (there is no disk tier)")
    return out


def check_hmac_secret(secret: bytes, algorithms: Sequence[str]) -> None:
    """Refuse an HMAC secret shorter than the longest hash of the HS algorithms in use."""
    need = max(
        (HMAC_MIN_SECRET_BYTES[a] for a in algorithms if a in HMAC_MIN_SECRET_BYTES), default=32
    )
    if len(secret) < need:
        raise ConfigurationError(
            f"invalid jwt_secret: expected at least {need} bytes (got {len(secret)} bytes)"
        )

"""The settings table: one `Setting` row per setting (name, parser, default, help), and
the command-line flags built from it."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from epistemic_kvcache.config.parsing import (
    choice,
    format_size,
    nonneg_seconds,
    parse_address,
    parse_address_or_off,
    parse_algorithms,
    parse_bool,
    parse_claim,
    parse_cluster_url,
    parse_fraction,
    parse_key_prefix,
    parse_list,
    parse_log_level,
    parse_nonneg_int,
    parse_optional_text,
    parse_path,
    parse_positive_int,
    parse_secret,
    parse_size,
    parse_size_or_zero,
    parse_tokens,
    pos_seconds,
)
from epistemic_kvcache.config.schema import (
    CONFIG_FILE_ENV,
    ENV_PREFIX,
    PERSIST_DIR_ENV_ALIAS,
    Address,
    ServerConfig,
)
from epistemic_kvcache.options import DEFAULT_STORE_OPTIONS, StoreOptions
from epistemic_kvcache.shared import (
    ServerLimits,
)

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
_S = DEFAULT_STORE_OPTIONS

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
            parse, metavar = pos_seconds, "SECONDS"
        else:
            parse, metavar = parse_positive_int, "N"
        help_text = _LIMIT_HELP.get(f.name, f.name.replace("_", " "))
        out.append(Setting(f.name, parse, getattr(defaults, f.name), help_text, metavar))
    return out


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "addr", parse_address, _D.addr, "HTTP listen address (port 0: any free port)", "HOST:PORT"
    ),
    Setting(
        "resp_addr",
        parse_address_or_off,
        _D.resp_addr,
        "Redis RESP listen address, or 'off'",
        "HOST:PORT|off",
    ),
    Setting(
        "backend",
        choice("durable", "memory"),
        _D.backend,
        "durable (disk-backed) or memory (in-process, ephemeral)",
        "durable|memory",
    ),
    Setting(
        "persist_dir",
        parse_path,
        _D.persist_dir,
        "where the durable store (and a generated token) live",
        "DIR",
        extra_env=(PERSIST_DIR_ENV_ALIAS,),
        path_like=True,
    ),
    Setting(
        "epoch_dir",
        parse_path,
        None,
        "epoch registry, shareable by servers on one host (default: <persist-dir>/epochs)",
        "DIR",
        path_like=True,
    ),
    Setting(
        "token",
        parse_tokens,
        _D.tokens,
        "accepted bearer token for tenant 'default' (repeatable; prefer --token-file)",
        "TOKEN",
        kind="append",
        secret=True,
    ),
    Setting(
        "token_file",
        parse_path,
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
        parse_secret,
        None,
        "HMAC secret for HS256/384/512 JWTs (>= 32 bytes; prefer --jwt-secret-file)",
        "SECRET",
        secret=True,
    ),
    Setting(
        "jwt_secret_file",
        parse_path,
        None,
        "file holding the HMAC secret",
        "FILE",
        path_like=True,
    ),
    Setting(
        "jwt_public_key",
        parse_path,
        None,
        "PEM public key (or certificate) verifying RS*/PS*/ES*/EdDSA JWTs",
        "FILE",
        path_like=True,
    ),
    Setting(
        "jwt_jwks",
        parse_path,
        None,
        "JWKS file of public keys, selected by the token's kid",
        "FILE",
        path_like=True,
    ),
    Setting(
        "jwt_algorithms",
        parse_algorithms,
        _D.jwt_algorithms,
        "accepted JWT algorithms, comma-separated (default: from the keys)",
        "ALGS",
    ),
    Setting("jwt_issuer", parse_optional_text, None, "required JWT iss", "ISS"),
    Setting(
        "jwt_audience",
        parse_list,
        _D.jwt_audience,
        "accepted JWT aud values, comma-separated (one must match)",
        "AUD",
    ),
    Setting(
        "jwt_tenant_claim",
        parse_claim,
        _D.jwt_tenant_claim,
        "JWT claim naming the tenant (falls back to sub)",
        "CLAIM",
    ),
    Setting(
        "jwt_leeway_s",
        nonneg_seconds,
        _D.jwt_leeway_s,
        "clock skew allowed on exp/nbf/iat",
        "SECONDS",
    ),
    Setting("tls_cert", parse_path, None, "TLS certificate chain (PEM)", "FILE", path_like=True),
    Setting("tls_key", parse_path, None, "TLS private key (PEM)", "FILE", path_like=True),
    Setting(
        "tls_client_ca",
        parse_path,
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
        "hot_capacity_bytes", parse_size_or_zero, _S.hot_capacity_bytes, "hot tier (RAM)", "SIZE"
    ),
    Setting(
        "warm_capacity_bytes",
        parse_size_or_zero,
        _S.warm_capacity_bytes,
        "warm tier (RAM, compressed)",
        "SIZE",
    ),
    Setting(
        "cold_capacity_bytes",
        parse_size,
        _S.cold_capacity_bytes,
        "cold tier (disk, durable backend)",
        "SIZE",
    ),
    Setting(
        "dedup_scope",
        choice("namespace", "global"),
        _S.dedup_scope,
        "share identical bytes within a namespace (default) or globally",
        "namespace|global",
    ),
    Setting(
        "max_pinned_fraction",
        parse_fraction,
        _S.max_pinned_fraction,
        "share of the capacity one tenant may pin (pins and snapshots; cold tier, or RAM "
        "for the memory backend)",
        "FRACTION",
    ),
    Setting(
        "max_snapshots_per_tenant",
        parse_positive_int,
        _S.max_snapshots_per_tenant,
        "live snapshots one tenant may hold",
        "N",
    ),
    Setting(
        "max_keys_per_tenant",
        parse_nonneg_int,
        _S.max_keys_per_tenant,
        "keys one tenant may hold (0: no limit); a tenant at its limit gets its own error",
        "N",
    ),
    Setting(
        "max_epoch_scopes_per_tenant",
        parse_positive_int,
        _S.max_epoch_scopes_per_tenant,
        "epoch scopes one tenant may register (scopes without live entries are pruned first)",
        "N",
    ),
    Setting(
        "rebuild_index",
        parse_bool,
        _S.rebuild_index,
        "rebuild the durable store's index from its log at start (instead of refusing to "
        "start when the index is missing or damaged)",
        kind="bool",
    ),
    Setting(
        "first_write_wins_tenants",
        parse_list,
        _D.first_write_wins_tenants,
        "tenants for which a PUT of an existing key with other bytes is refused (conflict) "
        "instead of replacing it, comma-separated; * for every tenant",
        "TENANTS",
    ),
    Setting(
        "metrics_tenants",
        parse_list,
        _D.metrics_tenants,
        "tenants allowed to read /metrics (store-wide totals), comma-separated; empty: nobody",
        "TENANTS",
    ),
    Setting(
        "cluster_url",
        parse_cluster_url,
        None,
        "cluster mode: redis[s]://[user[:password]@]host:port[,host:port...] of a Redis/Valkey "
        "Cluster shared by every front-end (see docs/cluster.md)",
        "URL",
        secret=True,
    ),
    Setting(
        "cluster_tls_ca",
        parse_path,
        None,
        "CA bundle verifying the cluster's TLS certificates (rediss://)",
        "FILE",
        path_like=True,
    ),
    Setting(
        "cluster_password_file",
        parse_path,
        None,
        "file whose first line is the cluster password (replaces one in the URL)",
        "FILE",
        path_like=True,
    ),
    Setting(
        "cluster_wait_replicas",
        parse_nonneg_int,
        _S.cluster_wait_replicas,
        "acknowledge a write once this many replicas have it (WAIT); 0: once the master has it",
        "N",
    ),
    Setting(
        "cluster_wait_timeout_s",
        pos_seconds,
        _S.cluster_wait_timeout_s,
        "how long a write waits for its replicas before it fails (retryably)",
        "SECONDS",
    ),
    Setting(
        "cluster_retry_window_s",
        pos_seconds,
        _S.cluster_retry_window_s,
        "how long an operation retries through a failover or resharding before it fails; "
        "longer than the cluster's failover time hides failovers from clients",
        "SECONDS",
    ),
    Setting(
        "cluster_key_prefix",
        parse_key_prefix,
        _S.cluster_key_prefix,
        "prefix of every key this deployment writes in the cluster (several deployments may "
        "share one cluster under different prefixes)",
        "WORD",
    ),
    Setting(
        "cluster_block_ttl_s",
        nonneg_seconds,
        _S.cluster_block_ttl_s,
        "blocks expire this long after their last new reference unless pinned; with a "
        "volatile-* maxmemory-policy the cluster evicts only blocks (0: no expiry)",
        "SECONDS",
    ),
    Setting(
        "cluster_scrub_interval_s",
        nonneg_seconds,
        _S.cluster_scrub_interval_s,
        "recount block references and reclaim what crashes leaked this often (one front-end "
        "at a time; 0: never)",
        "SECONDS",
    ),
    *_limit_settings(),
    Setting(
        "store_threads",
        parse_positive_int,
        _D.store_threads,
        "threads running blocking store calls",
        "N",
    ),
    Setting(
        "event_loops",
        parse_nonneg_int,
        _D.event_loops,
        "event loops (threads) serving both wires over the one store, each with its own "
        "listeners (SO_REUSEPORT), each connection on the loop with the fewest; 0: one per "
        "usable core (CPU affinity and cgroup quota), at most 16; 1: a single loop, no extra "
        "threads",
        "N",
    ),
    Setting(
        "drain_delay_s",
        nonneg_seconds,
        _D.drain_delay_s,
        "on SIGTERM, how long to keep serving (and accepting) while /readyz already "
        "answers 503, so load balancers stop sending new connections first; 0: stop "
        "accepting at once",
        "SECONDS",
    ),
    Setting(
        "shutdown_timeout_s",
        pos_seconds,
        _D.shutdown_timeout_s,
        "on SIGTERM, after drain_delay_s: the hard bound on finishing the requests in "
        "flight (each connection closes at its next boundary between requests; what is "
        "left then is cut)",
        "SECONDS",
    ),
    Setting("log_level", parse_log_level, _D.log_level, "debug, info, warning, error", "LEVEL"),
    Setting(
        "log_format",
        choice("text", "json"),
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
        nonneg_seconds,
        _D.stats_log_interval_s,
        "log hit rate, dedup and tier occupancy this often (0: never)",
        "SECONDS",
    ),
    Setting(
        "retire_interval_s",
        nonneg_seconds,
        _D.retire_interval_s,
        "sweep stale epoch entries and expired snapshots this often, bounded per sweep (0: never)",
        "SECONDS",
    ),
)

SETTINGS_BY_NAME: Mapping[str, Setting] = {s.name: s for s in SETTINGS}
LIMIT_NAMES = frozenset(f.name for f in dataclasses.fields(ServerLimits))
STORE_NAMES = (
    frozenset(f.name for f in dataclasses.fields(StoreOptions) if f.name in SETTINGS_BY_NAME)
    - LIMIT_NAMES
)
"""Settings that are `StoreOptions` fields of the same name (`max_block_bytes` is a limit)."""
RENAMED = {"token": "tokens"}
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

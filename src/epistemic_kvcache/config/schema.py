"""The configuration's shape: one frozen `ServerConfig`, its listen `Address`, and the
names the server and the client share (environment prefix, JWT algorithms)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from epistemic_kvcache.config.cgroup import usable_cores
from epistemic_kvcache.options import DEFAULT_STORE_OPTIONS, StoreOptions
from epistemic_kvcache.shared import (
    DEFAULT_HOST,
    DEFAULT_HTTP_PORT,
    DEFAULT_RESP_PORT,
    ServerLimits,
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


MAX_AUTO_EVENT_LOOPS = 16
"""`event_loops = 0` uses one loop per usable core, at most this many."""
MAX_EVENT_LOOPS = 256
"""The most event loops one server runs (each is a thread with its own listeners)."""
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
    store: StoreOptions = DEFAULT_STORE_OPTIONS
    """Tiers, quotas, durability and cluster tuning, handed whole to the backend; the
    settings of the same names fill it (`max_block_bytes` from `limits`,
    `first_write_wins` from `first_write_wins_tenants`)."""
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
    limits: ServerLimits = field(default_factory=ServerLimits)
    store_threads: int = 32
    event_loops: int = 0
    """Event loops (threads) serving both wires; 0: one per usable core, at most
    `MAX_AUTO_EVENT_LOOPS` (`resolved_event_loops`)."""
    drain_delay_s: float = 0.0
    """On SIGTERM: serve (not ready) this long before closing the listeners."""
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
    def resolved_event_loops(self) -> int:
        """How many event loops serve: `event_loops`, or for 0 one per usable core (at
        most `MAX_AUTO_EVENT_LOOPS`)."""
        if self.event_loops > 0:
            return self.event_loops
        return min(usable_cores(), MAX_AUTO_EVENT_LOOPS)

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

    @property
    def cluster_mode(self) -> bool:
        """Whether the store is a Redis/Valkey Cluster (`cluster_url` is set)."""
        return self.cluster_url is not None

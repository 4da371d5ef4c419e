"""`KvCacheConfig`: where the server is, how to trust it, how long to wait.

Trust rules are enforced when the object is built, so a bad setting fails at start-up
rather than on the first cache miss:

- plain `http://` is accepted only for loopback hosts (`localhost`, `127.0.0.0/8`, `::1`),
  or anywhere with the explicit `allow_insecure_http=True` (an isolated network; the
  client-side match of the server's `--allow-insecure-bind`);
- anything else needs `https://`, always with certificate and host-name verification
  (trust roots from `ca_file`/`ca_dir`, else `SSL_CERT_FILE`/`REQUESTS_CA_BUNDLE`/
  `SSL_CERT_DIR`, else the system store). There is deliberately no switch that turns
  verification off;
- a client identity for mTLS is a certificate plus (optionally) a separate key file.
"""

from __future__ import annotations

import difflib
import logging
import os
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.shared import DEFAULT_HOST, DEFAULT_HTTP_PORT, is_loopback_host

log = logging.getLogger(__name__)

ENV_PREFIX = "EPISTEMIC_GRAPH_KVCACHE_"
CLIENT_ENV_PREFIX = ENV_PREFIX + "CLIENT_"
"""Client-only variables live under this prefix; the server never reads them."""

# Shared on purpose with the server: where the server is, and the token.
ENV_URL = ENV_PREFIX + "URL"
ENV_ADDR = ENV_PREFIX + "ADDR"
ENV_TOKEN = ENV_PREFIX + "TOKEN"
# Client only.
ENV_TOKEN_FILE = CLIENT_ENV_PREFIX + "TOKEN_FILE"
ENV_CLIENT_CERT = CLIENT_ENV_PREFIX + "CERT"
ENV_CLIENT_KEY = CLIENT_ENV_PREFIX + "KEY"
ENV_CONNECT_TIMEOUT = CLIENT_ENV_PREFIX + "CONNECT_TIMEOUT_S"
ENV_READ_TIMEOUT = CLIENT_ENV_PREFIX + "READ_TIMEOUT_S"
ENV_MAX_CONNECTIONS = CLIENT_ENV_PREFIX + "MAX_CONNECTIONS"
ENV_LOOKUP_TIMEOUT = CLIENT_ENV_PREFIX + "LOOKUP_TIMEOUT_S"
ENV_BREAKER_MAX_BACKOFF = CLIENT_ENV_PREFIX + "BREAKER_MAX_BACKOFF_S"
ENV_ALLOW_INSECURE_HTTP = CLIENT_ENV_PREFIX + "ALLOW_INSECURE_HTTP"

DEPRECATED_ENV = {
    ENV_PREFIX + "CONNECT_TIMEOUT_S": ENV_CONNECT_TIMEOUT,
    ENV_PREFIX + "READ_TIMEOUT_S": ENV_READ_TIMEOUT,
    ENV_PREFIX + "MAX_CONNECTIONS": ENV_MAX_CONNECTIONS,
}
"""Old client names -> new ones. Still read (when the new one is unset), with a warning;
`EPISTEMIC_GRAPH_KVCACHE_MAX_CONNECTIONS` is also the server's connection limit."""

CLIENT_ENV_NAMES = (
    ENV_URL,
    ENV_ADDR,
    ENV_TOKEN,
    ENV_TOKEN_FILE,
    ENV_CLIENT_CERT,
    ENV_CLIENT_KEY,
    ENV_CONNECT_TIMEOUT,
    ENV_READ_TIMEOUT,
    ENV_MAX_CONNECTIONS,
    ENV_LOOKUP_TIMEOUT,
    ENV_BREAKER_MAX_BACKOFF,
    ENV_ALLOW_INSECURE_HTTP,
)
"""Every `EPISTEMIC_GRAPH_KVCACHE_*` variable `KvCacheConfig.from_env` reads
(docs/configuration.md lists them); plus `SSL_CERT_FILE`, `REQUESTS_CA_BUNDLE`,
`SSL_CERT_DIR` for trust roots."""

DEFAULT_ADDR = f"{DEFAULT_HOST}:{DEFAULT_HTTP_PORT}"
DEFAULT_CONNECT_TIMEOUT_S = 2.0
"""Connecting on a LAN takes well under a millisecond; 2 s means the server is not there."""
DEFAULT_READ_TIMEOUT_S = 2.0
"""Transfers (GET, PUT, batches, deletes): the longest wait for the next byte (per socket
send or receive, not for the whole body, so a large block that keeps flowing is never cut
off). A durable PUT's group-commit fsync usually answers in milliseconds; a server silent
for 2 s is stalled, and recomputing the KV is cheaper than waiting longer. Raise it for
very slow disks."""
DEFAULT_LOOKUP_TIMEOUT_S = 1.0
"""Lookups (HEAD, batch exists, the breaker's probe): an index read in RAM on the server,
answered in well under a millisecond; LMCache blocks a request on them."""
DEFAULT_BREAKER_MAX_BACKOFF_S = 5.0
"""After a timeout or a refused connection the client fails fast and probes the server
in the background, at most this far apart (0 disables the breaker)."""
DEFAULT_MAX_CONNECTIONS = 16
"""Keep-alive connections kept per client; one per concurrently requesting thread."""


def read_token_file(path: str, setting: str) -> str:
    """The token in `path`: its first non-empty, non-comment line (a mounted secret)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except OSError as exc:
        raise ConfigurationError(
            f"invalid {setting}: cannot read {path!r} ({exc.strerror})"
        ) from None
    for line in lines:
        if line and not line.startswith("#"):
            return line.split()[0]
    raise ConfigurationError(f"invalid {setting}: no token in {path!r}")


def url_from_addr(addr: str) -> str:
    """`host:port` -> base URL: http for loopback hosts, https for anything else."""
    addr = addr.strip()
    if "://" in addr:
        raise ConfigurationError(
            f"invalid {ENV_ADDR}: expected host:port, not a URL (got {addr!r}); "
            f"use {ENV_URL} for a full URL"
        )
    parsed = urllib.parse.urlsplit(f"//{addr}")
    try:
        port = parsed.port
    except ValueError as exc:
        raise ConfigurationError(f"invalid {ENV_ADDR}: bad port (got {addr!r})") from exc
    host = parsed.hostname
    if not host or port is None:
        raise ConfigurationError(f"invalid {ENV_ADDR}: expected host:port (got {addr!r})")
    scheme = "http" if is_loopback_host(host) else "https"
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return f"{scheme}://{netloc}"


@dataclass(frozen=True, slots=True)
class KvCacheConfig:
    """Client settings. Validated on construction (raises `ConfigurationError`)."""

    base_url: str = f"http://{DEFAULT_ADDR}"
    """`http://127.0.0.1:9130` or `https://kv.example:9130[/prefix]`."""
    token: str | None = field(default=None, repr=False)
    """Bearer token (or JWT) sent with every request."""
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S
    """Transfers: the longest wait for the next byte (see `DEFAULT_READ_TIMEOUT_S`)."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    ca_file: str | None = None
    """PEM bundle of trusted CAs (https only)."""
    ca_dir: str | None = None
    """Directory of hashed CA certificates (https only)."""
    client_cert: str | None = None
    """PEM client certificate for mTLS (may also hold the key)."""
    client_key: str | None = None
    """PEM private key for `client_cert`, when it is in a separate file."""
    lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S
    """Lookups (exists, size, the breaker's probe); also caps their connect timeout."""
    breaker_max_backoff_s: float = DEFAULT_BREAKER_MAX_BACKOFF_S
    """Longest pause between probes while failing fast; 0 turns the breaker off."""
    allow_insecure_http: bool = False
    """Allow plain `http://` to a non-loopback host (token and data unencrypted): only
    on an isolated network, matching the server's `--allow-insecure-bind`."""

    def __post_init__(self) -> None:
        url = self.base_url.strip().rstrip("/")
        parsed = urllib.parse.urlsplit(url)
        scheme = parsed.scheme.lower()
        if scheme not in ("http", "https"):
            raise ConfigurationError(
                f"invalid base_url: scheme must be http or https (got {self.base_url!r})"
            )
        try:
            port = parsed.port
        except ValueError as exc:
            raise ConfigurationError(f"invalid base_url: bad port (got {self.base_url!r})") from exc
        host = parsed.hostname
        if not host:
            raise ConfigurationError(f"invalid base_url: no host (got {self.base_url!r})")
        if parsed.query or parsed.fragment or parsed.username or parsed.password:
            raise ConfigurationError(
                "invalid base_url: query, fragment and user-info are not allowed "
                f"(got {self.base_url!r}); pass the token separately"
            )
        if not isinstance(self.allow_insecure_http, bool):
            raise ConfigurationError(
                f"invalid allow_insecure_http: expected true or false "
                f"(got {self.allow_insecure_http!r})"
            )
        if scheme == "http" and not is_loopback_host(host) and not self.allow_insecure_http:
            raise ConfigurationError(
                f"invalid base_url {self.base_url!r}: plain http is allowed only for loopback "
                "hosts; use https:// (with a CA the client trusts) for remote servers, or "
                "set allow_insecure_http=True on an isolated network"
            )
        if scheme == "http" and (self.client_cert or self.client_key):
            raise ConfigurationError(
                "invalid client_cert: a client certificate needs an https:// base_url "
                f"(got {self.base_url!r})"
            )
        if port is not None and not 0 < port < 65536:
            raise ConfigurationError(f"invalid base_url: port out of range (got {port})")
        object.__setattr__(self, "base_url", url)
        for name in ("connect_timeout_s", "read_timeout_s", "lookup_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigurationError(
                    f"invalid {name}: expected a positive number of seconds (got {value!r})"
                )
        backoff = self.breaker_max_backoff_s
        if isinstance(backoff, bool) or not isinstance(backoff, int | float) or backoff < 0:
            raise ConfigurationError(
                "invalid breaker_max_backoff_s: expected seconds >= 0, 0 = no breaker "
                f"(got {backoff!r})"
            )
        if (
            isinstance(self.max_connections, bool)
            or not isinstance(self.max_connections, int)
            or self.max_connections < 1
        ):
            raise ConfigurationError(
                f"invalid max_connections: expected a positive integer "
                f"(got {self.max_connections!r})"
            )
        if self.token is not None and (not self.token or any(c in self.token for c in "\r\n")):
            raise ConfigurationError("invalid token: empty or contains a line break")
        if self.client_key and not self.client_cert:
            raise ConfigurationError("invalid client_key: given without client_cert")
        for name in ("ca_file", "client_cert", "client_key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigurationError(f"invalid {name}: no such file (got {path!r})")
        if self.ca_dir is not None and not os.path.isdir(self.ca_dir):
            raise ConfigurationError(f"invalid ca_dir: no such directory (got {self.ca_dir!r})")

    # -- derived ------------------------------------------------------------------------
    @property
    def scheme(self) -> str:
        """`http` or `https`."""
        return urllib.parse.urlsplit(self.base_url).scheme.lower()

    @property
    def host(self) -> str:
        """Host name or IP literal (without brackets)."""
        return urllib.parse.urlsplit(self.base_url).hostname or ""

    @property
    def port(self) -> int:
        """Port, defaulting to 80 / 443 by scheme."""
        port = urllib.parse.urlsplit(self.base_url).port
        if port is not None:
            return port
        return 443 if self.scheme == "https" else 80

    @property
    def path_prefix(self) -> str:
        """Path the API is mounted under ('' for the root)."""
        return urllib.parse.urlsplit(self.base_url).path.rstrip("/")

    def with_overrides(self, **changes: Any) -> KvCacheConfig:
        """A copy with some fields replaced (validated again)."""
        return replace(self, **changes)

    # -- construction -------------------------------------------------------------------
    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> KvCacheConfig:
        """Build from the environment (docs/configuration.md); keyword arguments win over it.

        `EPISTEMIC_GRAPH_KVCACHE_URL` wins over `_ADDR` (`host:port`; loopback hosts get
        `http://`, others `https://`). Trust roots: `SSL_CERT_FILE`, else
        `REQUESTS_CA_BUNDLE`, and `SSL_CERT_DIR`; none of them means the system store.
        """
        env = os.environ if environ is None else environ

        def get(name: str) -> str | None:
            value = env.get(name)
            return value if value else None

        kwargs: dict[str, Any] = {}
        url = get(ENV_URL)
        addr = get(ENV_ADDR)
        if url is not None:
            kwargs["base_url"] = url
        else:
            kwargs["base_url"] = url_from_addr(addr or DEFAULT_ADDR)
        kwargs["token"] = get(ENV_TOKEN)
        token_file = get(ENV_TOKEN_FILE)
        if kwargs["token"] is None and token_file is not None:
            kwargs["token"] = read_token_file(token_file, ENV_TOKEN_FILE)
        kwargs["client_cert"] = get(ENV_CLIENT_CERT)
        kwargs["client_key"] = get(ENV_CLIENT_KEY)
        kwargs["ca_file"] = get("SSL_CERT_FILE") or get("REQUESTS_CA_BUNDLE")
        kwargs["ca_dir"] = get("SSL_CERT_DIR")
        for env_name, key, conv in (
            (ENV_CONNECT_TIMEOUT, "connect_timeout_s", float),
            (ENV_READ_TIMEOUT, "read_timeout_s", float),
            (ENV_MAX_CONNECTIONS, "max_connections", int),
            (ENV_LOOKUP_TIMEOUT, "lookup_timeout_s", float),
            (ENV_BREAKER_MAX_BACKOFF, "breaker_max_backoff_s", float),
        ):
            source = env_name
            raw = get(env_name)
            if raw is None:
                old = next((o for o, n in DEPRECATED_ENV.items() if n == env_name), None)
                if old is None:
                    continue
                raw = get(old)
                if raw is None:
                    continue
                log.warning("%s is deprecated for the client: set %s instead", old, env_name)
                source = old
            try:
                kwargs[key] = conv(raw)
            except ValueError as exc:
                raise ConfigurationError(
                    f"invalid {source}: expected a number (got {raw!r})"
                ) from exc
        insecure = get(ENV_ALLOW_INSECURE_HTTP)
        if insecure is not None:
            if insecure.lower() not in ("1", "true", "yes", "0", "false", "no"):
                raise ConfigurationError(
                    f"invalid {ENV_ALLOW_INSECURE_HTTP}: expected true or false (got {insecure!r})"
                )
            kwargs["allow_insecure_http"] = insecure.lower() in ("1", "true", "yes")
        known = set(CLIENT_ENV_NAMES)
        for name in sorted(env):
            if name.startswith(CLIENT_ENV_PREFIX) and name not in known:
                hint = difflib.get_close_matches(name, CLIENT_ENV_NAMES, n=1)
                log.warning(
                    "unknown environment variable %s ignored%s",
                    name,
                    f" (did you mean {hint[0]}?)" if hint else "",
                )
        kwargs.update(overrides)
        if kwargs.get("base_url") is None:
            del kwargs["base_url"]
        return cls(**kwargs)

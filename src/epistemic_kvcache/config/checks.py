"""Checks of a loaded configuration: across settings (`load_config` runs them), on the
machine (`serve` runs them before it creates any file), and findings that are only
warnings."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import ssl
from collections.abc import Sequence
from pathlib import Path

from epistemic_kvcache.config.cgroup import cgroup_memory_limit
from epistemic_kvcache.config.parsing import format_size
from epistemic_kvcache.config.schema import (
    HMAC_MIN_SECRET_BYTES,
    MAX_EVENT_LOOPS,
    Address,
    ServerConfig,
)
from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.proto.resp_types import MAX_LIMIT
from epistemic_kvcache.shared import ServerLimits


def validate(c: ServerConfig, *, file_checks: bool = True) -> None:
    """Cross-setting checks; each names the settings involved. `file_checks=False`
    leaves out what looks at this machine's files (the named files exist and are
    readable, the TLS pair loads, the persist dir is a directory): a configuration
    meant for another machine (a manifest's) is checked for everything else."""

    def fail(name: str, message: str) -> None:
        raise ConfigurationError(f"invalid {name}: {message}")

    if c.resp_addr is not None and c.resp_addr.port != 0 and c.resp_addr == c.addr:
        fail("resp_addr", f"same address as addr (got '{c.resp_addr}')")
    for name in ("persist_dir", "epoch_dir"):
        path = getattr(c, name)
        if file_checks and path is not None and path.exists() and not path.is_dir():
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
    if file_checks:
        _check_files(c)

    _check_jwt(c)
    _check_limits(c)


_FILE_SETTINGS = (
    "cluster_tls_ca",
    "cluster_password_file",
    "token_file",
    "jwt_secret_file",
    "jwt_public_key",
    "jwt_jwks",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
)


def _check_files(c: ServerConfig) -> None:
    """Every file a setting names exists and is readable here; the TLS pair loads."""
    for name in _FILE_SETTINGS:
        path = getattr(c, name)
        if path is not None and not path.is_file():
            raise ConfigurationError(f"invalid {name}: file not found (got '{path}')")
        if path is not None and not os.access(path, os.R_OK):
            raise ConfigurationError(
                f"invalid {name}: file not readable by this user (got '{path}')"
            )
    if c.tls_cert is not None and c.tls_key is not None:
        _check_tls_files(c.tls_cert, c.tls_key, c.tls_client_ca)


def _check_jwt(c: ServerConfig) -> None:
    def fail(name: str, message: str) -> None:
        raise ConfigurationError(f"invalid {name}: {message}")

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


def _check_limits(c: ServerConfig) -> None:
    def fail(name: str, message: str) -> None:
        raise ConfigurationError(f"invalid {name}: {message}")

    lim = c.limits
    check_limit_range(lim)
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
    if c.event_loops > MAX_EVENT_LOOPS:
        fail("event_loops", f"expected at most {MAX_EVENT_LOOPS} (got {c.event_loops})")


def check_limit_range(limits: ServerLimits) -> None:
    """Every integer limit within what the compiled build holds (`MAX_LIMIT`): the
    compiled RESP framer keeps its limits in C integers, and a larger value would start
    the server and then fail its first connection."""
    for f in dataclasses.fields(limits):
        value = getattr(limits, f.name)
        if type(value) is int and value > MAX_LIMIT:
            raise ConfigurationError(
                f"invalid {f.name}: expected at most {MAX_LIMIT} (2**62, the most the "
                f"compiled build holds in its 64-bit C integers), got {value}"
            )


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
    load_tls_files(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), cert, key, client_ca)


def load_tls_files(ctx: ssl.SSLContext, cert: Path, key: Path, client_ca: Path | None) -> None:
    """Load the certificate chain and (for mTLS) the client CA into `ctx`, raising a
    `ConfigurationError` that names the setting at fault. The configuration check and
    the listeners' context (`server.tls.server_ssl_context`) both load through here."""
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
    except FileNotFoundError as exc:
        raise ConfigurationError(
            f"invalid tls_cert/tls_key: file not found ({exc.filename})"
        ) from None
    except OSError as exc:
        raise ConfigurationError(
            f"invalid tls_cert/tls_key: cannot load '{cert}' with '{key}': {exc}"
        ) from None
    if client_ca is not None:
        try:
            ctx.load_verify_locations(cafile=str(client_ca))
        except ssl.SSLError as exc:
            raise ConfigurationError(
                f"invalid tls_client_ca: no usable CA certificate in '{client_ca}' "
                f"({exc.reason or exc})"
            ) from None
        except OSError as exc:
            raise ConfigurationError(
                f"invalid tls_client_ca: cannot load '{client_ca}': {exc}"
            ) from None


def _memory_limit_bytes() -> tuple[int, str] | None:
    """RAM this process may use and what sets it: the tightest cgroup limit (v2 or v1, on
    its cgroup or one above) where it is under physical RAM, else physical RAM."""
    try:
        phys: int | None = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (OSError, ValueError):
        phys = None
    limit = cgroup_memory_limit()
    if limit is not None and (phys is None or limit < phys):
        return limit, "this process's cgroup memory limit"
    return (phys, "this machine's memory") if phys is not None else None


def _disk_size_bytes(path: Path) -> int | None:
    """Size of the file system that holds `path` (or its nearest existing parent)."""
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).total
    except OSError:
        return None


def resource_warnings(c: ServerConfig, explicit: set[str], *, machine: bool = True) -> list[str]:
    """Settings that are valid but cannot work as written (`machine`: on this machine,
    its memory and disk; left out for a configuration meant for another machine)."""
    out: list[str] = []
    lim = c.limits
    if lim.tenant_connection_cap < lim.max_connections_per_tenant:
        out.append(
            f"max_connections_per_tenant = {lim.max_connections_per_tenant} is clamped to "
            f"{lim.tenant_connection_cap}, half of max_connections = {lim.max_connections}: "
            "one tenant may hold at most half of a listener's connections (raise "
            "max_connections to let a tenant hold more)"
        )
    ram = _memory_limit_bytes() if machine else None
    tiers = c.store.hot_capacity_bytes + c.store.warm_capacity_bytes
    if ram is not None and tiers > ram[0]:
        out.append(
            f"hot_capacity_bytes + warm_capacity_bytes = {format_size(tiers)} exceed "
            f"{ram[1]} ({format_size(ram[0])}): the tiers will never fill, the kernel "
            "will kill the server first"
        )
    if c.cluster_mode:
        pass  # the cluster holds the blocks: no disk tier here
    elif c.backend == "durable":
        disk = _disk_size_bytes(c.persist_dir) if machine else None
        cold = c.store.cold_capacity_bytes
        if disk is not None and cold > disk:
            out.append(
                f"cold_capacity_bytes = {format_size(cold)} exceeds the file "
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

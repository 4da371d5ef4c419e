"""TLS for both listeners, and the rule that keeps plaintext on loopback.

`server_ssl_context` builds the server side: TLS 1.2 minimum, the certificate chain
and key, and — when a client CA is given — mTLS (`CERT_REQUIRED`: a client without a
certificate signed by that CA fails the handshake). `check_bind` refuses a listener
on a non-loopback address without TLS unless the operator passed
`--allow-insecure-bind`.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from epistemic_kvcache.config import ServerConfig
from epistemic_kvcache.config import check_bind as check_bind  # noqa: PLC0414 - re-exported
from epistemic_kvcache.config.checks import load_tls_files


def server_ssl_context(cert: Path, key: Path, client_ca: Path | None = None) -> ssl.SSLContext:
    """A server `SSLContext` (TLS >= 1.2; mTLS when `client_ca` is given).

    Raises `ConfigurationError` naming the file that could not be used.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    ctx.options |= getattr(ssl, "OP_NO_RENEGOTIATION", 0)
    load_tls_files(ctx, cert, key, client_ca)
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_REQUIRED
    else:
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def ssl_context_from_config(config: ServerConfig) -> ssl.SSLContext | None:
    """The listeners' `SSLContext`, or None when TLS is not configured."""
    if config.tls_cert is None or config.tls_key is None:
        return None
    return server_ssl_context(config.tls_cert, config.tls_key, config.tls_client_ca)

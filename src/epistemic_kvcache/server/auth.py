"""Credentials -> `Identity`: the server's authenticator, how it is built and reloaded.

How it works:
- `CredentialAuthenticator` holds a token table (server/tokens.py: digests compared
  in constant time) and/or a JWT verifier (server/jwt_auth.py: pinned algorithms,
  strict claims). A credential shaped like a JWT (three base64url segments) goes to
  JWT verification when JWT is configured; everything else is looked up in the token
  table. Longer than `MAX_CREDENTIAL_BYTES`, it is refused before any parsing.
- `plan_authenticator` reads every credential source the configuration names and
  writes nothing; with none configured it accepts `<persist_dir>/token`, generating one
  that `AuthPlan.commit` writes only once start-up has passed every other check.
- `ReloadableAuthenticator.reload` (SIGHUP) builds a new plan and swaps it in at once;
  a reload that fails keeps the credentials in use.

Error messages never contain the credential.
"""

from __future__ import annotations

import logging
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from epistemic_kvcache.config import DEFAULT_TENANT, ServerConfig
from epistemic_kvcache.errors import AuthError, ConfigurationError
from epistemic_kvcache.server.context import Identity
from epistemic_kvcache.server.jwt_auth import JwtVerifier
from epistemic_kvcache.server.tokens import (
    GENERATED_TOKEN_FILENAME,
    TokenTable,
    ensure_generated_token,
    load_token_file,
    write_generated_token,
)

log = logging.getLogger("epistemic_kvcache.server.auth")

MAX_CREDENTIAL_BYTES = 16 * 1024
"""Longer credentials are refused before any parsing (a JWT is a few hundred bytes)."""

_JWT_SHAPE = re.compile(r"^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*$")


def looks_like_jwt(credential: str) -> bool:
    """Three base64url segments separated by dots."""
    return _JWT_SHAPE.fullmatch(credential) is not None


# -- the authenticator -----------------------------------------------------------------


class CredentialAuthenticator:
    """The server's `Authenticator`: a token table and/or a JWT verifier."""

    def __init__(self, tokens: TokenTable | None = None, jwt_verifier: JwtVerifier | None = None):
        if not tokens and jwt_verifier is None:
            raise ConfigurationError("no credentials configured: refusing to serve (fail closed)")
        self.tokens = tokens if tokens else None
        self.jwt = jwt_verifier

    def authenticate(self, credential: str) -> Identity:
        """An `Identity` for `credential`, or `AuthError` (never echoing it)."""
        if not credential:
            raise AuthError("missing credentials")
        if len(credential) > MAX_CREDENTIAL_BYTES:
            raise AuthError("invalid credentials: too long")
        if self.jwt is not None and looks_like_jwt(credential):
            return self.jwt.verify(credential)
        if self.tokens is not None:
            tenant = self.tokens.lookup(credential)
            if tenant is not None:
                return Identity(tenant=tenant, subject=f"token:{tenant}", method="token")
        raise AuthError("invalid credentials")


@dataclass(slots=True)
class AuthPlan:
    """An authenticator built from `config`, with the first-run token not yet on disk.

    `commit()` writes the generated token (if one is pending): start-up calls it only
    once every other check has passed, so a start-up that fails writes no file.
    """

    authenticator: CredentialAuthenticator
    token_path: Path | None = None
    """Where the generated token goes (None: no generated token in use)."""
    pending_token: str | None = field(default=None, repr=False)
    """The generated token still to be written (None: the file exists already)."""

    def commit(self) -> None:
        """Write the pending first-run token (mode 0600, directory 0700)."""
        path = self.token_path
        if path is None:
            return
        if self.pending_token is not None:
            token, self.pending_token = self.pending_token, None
            if not write_generated_token(path, token):
                # another process created it meanwhile: accept that one instead
                table = load_token_file(path)
                self.authenticator.tokens = table
        log.info(
            "no credentials configured: accepting the token in %s for tenant %r "
            "(clients: EPISTEMIC_GRAPH_KVCACHE_TOKEN=$(cat %s))",
            path.resolve(),
            DEFAULT_TENANT,
            path.resolve(),
        )


def plan_authenticator(config: ServerConfig) -> AuthPlan:
    """The authenticator `config` describes, reading files but writing none.

    With no credential source configured and `generate_token` on, it accepts
    `<persist_dir>/token` if that exists, else a new random token that `commit()`
    writes there. With `generate_token` off, raises `ConfigurationError` (fail closed).
    """
    table = TokenTable()
    for token in config.tokens:
        table.add(token, DEFAULT_TENANT)
    if config.token_file is not None:
        load_token_file(config.token_file, table)
    verifier = JwtVerifier.from_config(config) if config.jwt_enabled else None
    if config.auth_configured:
        return AuthPlan(CredentialAuthenticator(table, verifier))
    if not config.generate_token:
        raise ConfigurationError(
            "no credentials configured (--token, --token-file, --jwt-secret, "
            "--jwt-public-key or --jwt-jwks) and --no-generate-token: refusing to serve"
        )
    path = config.persist_dir / GENERATED_TOKEN_FILENAME
    if path.exists() or path.is_symlink():
        load_token_file(path, table)
        return AuthPlan(CredentialAuthenticator(table, verifier), path)
    if config.persist_dir.exists() and not config.persist_dir.is_dir():
        raise ConfigurationError(
            f"invalid persist_dir: '{config.persist_dir}' exists and is not a directory"
        )
    token = secrets.token_urlsafe(32)
    table.add(token, DEFAULT_TENANT, source=str(path))
    return AuthPlan(CredentialAuthenticator(table, verifier), path, token)


def build_authenticator(config: ServerConfig) -> CredentialAuthenticator:
    """The authenticator `config` describes (`plan_authenticator`, committed at once).

    With no credential source configured and `generate_token` on, creates (or reuses)
    `<persist_dir>/token` and accepts it for tenant `default`; its path is logged, the
    token never. With `generate_token` off, raises `ConfigurationError` (fail closed).
    """
    plan = plan_authenticator(config)
    plan.commit()
    return plan.authenticator


class ReloadableAuthenticator:
    """The server's authenticator: `reload()` (SIGHUP) re-reads the token file, the
    generated token, the JWT secret, public key and JWKS, and swaps them in at once;
    a reload that fails keeps the credentials in use."""

    def __init__(self, config: ServerConfig, current: CredentialAuthenticator) -> None:
        self._config = config
        self._current = current

    def authenticate(self, credential: str) -> Identity:
        return self._current.authenticate(credential)

    def reload(self) -> str:
        """Rebuild from the files; a summary of what is accepted now. Raises
        `ConfigurationError` (the old credentials stay in force)."""
        plan = plan_authenticator(self._config)
        if plan.pending_token is not None:
            raise ConfigurationError(
                f"invalid persist_dir: the generated token file '{plan.token_path}' is gone"
            )
        self._current = plan.authenticator
        tokens = plan.authenticator.tokens
        jwt_state = "on" if plan.authenticator.jwt else "off"
        return f"{len(tokens) if tokens else 0} token(s), JWT {jwt_state}"


# The token table's and the JWT verifier's public names are re-exported: server.auth is
# where callers (tests/servers.py, the tests) take every credential type from.
__all__ = [
    "GENERATED_TOKEN_FILENAME",
    "AuthPlan",
    "CredentialAuthenticator",
    "JwtVerifier",
    "ReloadableAuthenticator",
    "TokenTable",
    "build_authenticator",
    "ensure_generated_token",
    "load_token_file",
    "looks_like_jwt",
    "plan_authenticator",
]

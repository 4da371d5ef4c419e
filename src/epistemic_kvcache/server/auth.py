"""Credentials -> `Identity`: static bearer tokens and verified JWTs.

How it works:
- Tokens. Every accepted token is kept as its SHA-256 digest with its tenant. A
  credential is hashed once and compared with `hmac.compare_digest` against *every*
  entry (no early exit), so neither timing nor length reveals which token, if any,
  matched.
- JWTs. The accepted algorithms are pinned by configuration; the token header's `alg`
  only selects among them and must match the family of the key it is checked with, so
  an RSA public key can never act as an HMAC secret (key confusion) and `none` is never
  accepted. Keys come from an HMAC secret, a PEM public key or a JWKS file (selected by
  `kid`, an unknown `kid` is refused). `exp` is required; `nbf`/`iat` are honoured;
  all three must be JSON numbers (a string `"exp": "9999999999"` is refused by name);
  `iss`/`aud` are enforced when configured. The tenant comes from the configured claim
  (default `tenant`, else `sub`). Verified tokens are cached until their `exp`.
- A credential shaped like a JWT (three base64url segments) goes to JWT verification
  when JWT is configured; everything else is looked up in the token table.

Error messages never contain the credential.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import re
import secrets
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa

from epistemic_kvcache.config import (
    DEFAULT_TENANT,
    JWT_ALGORITHMS,
    ServerConfig,
    check_hmac_secret,
)
from epistemic_kvcache.errors import AuthError, ConfigurationError, InvalidKeyError
from epistemic_kvcache.server.context import Identity
from epistemic_kvcache.server.oplog import UNSAFE_TEXT
from epistemic_kvcache.shared import validate_namespace

log = logging.getLogger(__name__)

MAX_CREDENTIAL_BYTES = 16 * 1024
"""Longer credentials are refused before any parsing (a JWT is a few hundred bytes)."""

GENERATED_TOKEN_FILENAME = "token"  # noqa: S105 - a file name, not a secret

_JWT_SHAPE = re.compile(r"^[A-Za-z0-9_-]+\.[A-Za-z0-9_-]+\.[A-Za-z0-9_-]*$")
_VISIBLE_ASCII = re.compile(r"[!-~]+")
# Refused anywhere in a token file: control characters (C0, DEL, C1) other than tab, CR
# and LF, and the Unicode line separators (`splitlines` would split a line on them).
_FILE_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029]")

_FAMILY_ALGS: dict[str, frozenset[str]] = {
    "hmac": frozenset({"HS256", "HS384", "HS512"}),
    "rsa": frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512"}),
    "ec-P-256": frozenset({"ES256"}),
    "ec-P-384": frozenset({"ES384"}),
    "ec-P-521": frozenset({"ES512"}),
    "ec-secp256k1": frozenset({"ES256K"}),
    "okp": frozenset({"EdDSA"}),
}
_FAMILY_DEFAULT = {
    "hmac": "HS256",
    "rsa": "RS256",
    "ec-P-256": "ES256",
    "ec-P-384": "ES384",
    "ec-P-521": "ES512",
    "ec-secp256k1": "ES256K",
    "okp": "EdDSA",
}
_EC_CURVES = {"secp256r1": "P-256", "secp384r1": "P-384", "secp521r1": "P-521"}
MIN_RSA_BITS = 2048


def check_tenant_name(tenant: str) -> None:
    """Raise `InvalidKeyError` for a name that is no valid namespace or that holds a
    control character or line separator: tenant names are written into log lines, where
    a CR or LF would forge records (issue 23). Says which character, and where."""
    validate_namespace(tenant)
    bad = UNSAFE_TEXT.search(tenant)
    if bad is not None:
        raise InvalidKeyError(
            f"control character U+{ord(bad.group()):04X} at index {bad.start()} "
            "(tenant names may not hold control characters or line breaks)"
        )


def looks_like_jwt(credential: str) -> bool:
    """Three base64url segments separated by dots."""
    return _JWT_SHAPE.fullmatch(credential) is not None


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


# -- static tokens ---------------------------------------------------------------------


class TokenTable:
    """Accepted bearer tokens and their tenants, compared in constant time."""

    def __init__(self, entries: Iterable[tuple[str, str]] = ()) -> None:
        self._entries: list[tuple[bytes, str]] = []
        for token, tenant in entries:
            self.add(token, tenant)

    def add(self, token: str, tenant: str, *, source: str = "--token") -> None:
        """Accept `token` for `tenant`. A token may map to one tenant only.

        A token is 1.. visible ASCII characters (`!`..`~`): what an HTTP `Authorization`
        header and `redis-cli -a` carry unchanged. Anything else (control characters, NUL,
        non-ASCII) could never be presented by a client, so it is refused, never stored.
        """
        if not token or any(c.isspace() for c in token):
            raise ConfigurationError(f"invalid token in {source}: empty or contains whitespace")
        if not _VISIBLE_ASCII.fullmatch(token):
            raise ConfigurationError(
                f"invalid token in {source}: expected visible ASCII characters only "
                "(it holds a control or non-ASCII character)"
            )
        try:
            check_tenant_name(tenant)
        except InvalidKeyError as exc:
            raise ConfigurationError(f"invalid tenant in {source}: {exc}") from None
        digest = _digest(token)
        for known, known_tenant in self._entries:
            if hmac.compare_digest(known, digest):
                if known_tenant != tenant:
                    raise ConfigurationError(
                        f"invalid token in {source}: the same token is given for tenants "
                        f"{known_tenant!r} and {tenant!r}"
                    )
                return
        if len(token) < 16:
            log.warning("a token from %s is shorter than 16 characters; use a random one", source)
        self._entries.append((digest, tenant))

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, credential: str) -> str | None:
        """The tenant of `credential`, or None. Touches every entry whatever matches."""
        candidate = _digest(credential)
        found: str | None = None
        for digest, tenant in self._entries:
            if hmac.compare_digest(candidate, digest):
                found = tenant
        return found


def load_token_file(path: Path, table: TokenTable | None = None) -> TokenTable:
    """Read a token file into `table` (a new one by default).

    Format: one token per line, optionally followed by whitespace and a tenant (default
    `default`); blank lines and lines starting with `#` are ignored. A world-writable
    file is refused (anyone could add a token); a group- or world-readable one is
    accepted with a warning. A file that is not text (invalid UTF-8, a control character
    such as NUL anywhere) or holds no valid token is refused whole: a SIGHUP reload of a
    damaged file keeps the credentials in force instead of revoking them.
    """
    table = TokenTable() if table is None else table
    try:
        st = path.stat()
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigurationError(
            f"invalid token_file: cannot read '{path}': {exc.strerror}"
        ) from None
    except UnicodeDecodeError as exc:
        raise ConfigurationError(
            f"invalid token_file: '{path}' is not UTF-8 text (invalid byte at offset {exc.start})"
        ) from None
    if st.st_mode & stat.S_IWOTH:
        raise ConfigurationError(f"invalid token_file: '{path}' is world-writable; chmod 600 it")
    bad = _FILE_CONTROL.search(text)
    if bad is not None:
        lineno = text.count("\n", 0, bad.start()) + 1
        raise ConfigurationError(
            f"invalid token_file: '{path}' line {lineno}: control character "
            f"U+{ord(bad.group()):04X} (a token file is text: 'token [tenant]' lines)"
        )
    if st.st_mode & (stat.S_IROTH | stat.S_IRGRP):
        log.warning("token file %s is readable by group/others; chmod 600 it", path)
    count = 0
    for lineno, line in enumerate(text.splitlines(), start=1):
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        if len(fields) > 2:
            raise ConfigurationError(
                f"invalid token_file: '{path}' line {lineno}: expected 'token [tenant]' "
                f"(got {len(fields)} fields)"
            )
        tenant = fields[1] if len(fields) == 2 else DEFAULT_TENANT
        table.add(fields[0], tenant, source=f"'{path}' line {lineno}")
        count += 1
    if count == 0:
        raise ConfigurationError(f"invalid token_file: '{path}' holds no token")
    return table


def ensure_generated_token(persist_dir: Path) -> Path:
    """Create `<persist_dir>/token` (mode 0600, a random token) unless it exists; return it.

    An existing file is reused as it is, so clients keep working across restarts.
    """
    path = persist_dir / GENERATED_TOKEN_FILENAME
    _write_generated_token(path, secrets.token_urlsafe(32))
    return path


# -- JWT -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _JwtKey:
    key: Any
    algorithms: frozenset[str]
    kid: str | None
    source: str


def _public_key_family(key: Any) -> str:
    if isinstance(key, rsa.RSAPublicKey):
        if key.key_size < MIN_RSA_BITS:
            raise ValueError(f"RSA key of {key.key_size} bits, need at least {MIN_RSA_BITS}")
        return "rsa"
    if isinstance(key, ec.EllipticCurvePublicKey):
        curve = _EC_CURVES.get(key.curve.name, key.curve.name)
        if f"ec-{curve}" not in _FAMILY_ALGS:
            raise ValueError(f"unsupported elliptic curve {key.curve.name}")
        return f"ec-{curve}"
    if isinstance(key, ed25519.Ed25519PublicKey | ed448.Ed448PublicKey):
        return "okp"
    raise ValueError(f"unsupported public key type {type(key).__name__}")


def _allowed(family: str, configured: Sequence[str], own_alg: str | None) -> frozenset[str]:
    """Algorithms a key of `family` verifies: the configured ones of its family.

    Without configured algorithms: the key's own `alg` (JWKS) or the family default.
    """
    family_algs = _FAMILY_ALGS[family]
    if configured:
        allowed = family_algs & set(configured)
        if own_alg is not None:
            allowed &= {own_alg}
        return frozenset(allowed)
    if own_alg is not None:
        return frozenset({own_alg} & family_algs)
    return frozenset({_FAMILY_DEFAULT[family]})


def _load_pem_public_key(path: Path) -> Any:
    data = path.read_bytes()
    if b"PRIVATE KEY" in data:
        raise ValueError("holds a private key; give the public key only")
    if b"BEGIN CERTIFICATE" in data:
        return x509.load_pem_x509_certificate(data).public_key()
    return serialization.load_pem_public_key(data)


def _load_jwks(path: Path, configured: Sequence[str]) -> list[_JwtKey]:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigurationError(f"invalid jwt_jwks: cannot read '{path}': {exc}") from None
    raw_keys = doc.get("keys") if isinstance(doc, dict) else None
    if not isinstance(raw_keys, list):
        raise ConfigurationError(f"invalid jwt_jwks: '{path}' has no 'keys' array")
    out: list[_JwtKey] = []
    seen: set[str] = set()
    for index, jwk in enumerate(raw_keys):
        where = f"'{path}' key #{index}"
        if not isinstance(jwk, dict):
            raise ConfigurationError(f"invalid jwt_jwks: {where} is not an object")
        if jwk.get("use", "sig") != "sig":
            continue
        if jwk.get("kty") == "oct":
            raise ConfigurationError(
                f"invalid jwt_jwks: {where} is a symmetric (oct) key; use --jwt-secret-file"
            )
        if any(name in jwk for name in ("d", "p", "q")):
            raise ConfigurationError(f"invalid jwt_jwks: {where} holds private key material")
        kid = jwk.get("kid")
        if not isinstance(kid, str) or not kid:
            raise ConfigurationError(f"invalid jwt_jwks: {where} has no 'kid'")
        if kid in seen:
            raise ConfigurationError(f"invalid jwt_jwks: duplicate kid {kid!r} in '{path}'")
        seen.add(kid)
        own_alg = jwk.get("alg")
        if own_alg is not None and own_alg not in JWT_ALGORITHMS:
            raise ConfigurationError(
                f"invalid jwt_jwks: kid {kid!r} has unsupported alg {own_alg!r}"
            )
        try:
            key = jwt.PyJWK(jwk).key
            family = _public_key_family(key)
        except (jwt.PyJWTError, ValueError) as exc:
            raise ConfigurationError(f"invalid jwt_jwks: kid {kid!r}: {exc}") from None
        allowed = _allowed(family, configured, own_alg)
        if not allowed:
            log.warning("JWKS key %r fits none of --jwt-algorithms; it is not used", kid)
            continue
        out.append(_JwtKey(key, allowed, kid, f"jwks kid {kid!r}"))
    if not out:
        raise ConfigurationError(f"invalid jwt_jwks: '{path}' holds no usable signing key")
    return out


_NUMERIC_CLAIMS = ("exp", "nbf", "iat")
"""RFC 7519 §4.1.4-6: NumericDate claims, JSON numbers (PyJWT alone takes `"exp": "99"`)."""


class _ClaimTypeError(jwt.DecodeError):
    """A registered claim of the wrong JSON type (the message names claim and type)."""


class _StrictJWT(jwt.PyJWT):
    """PyJWT whose payload check (after the signature, before the time checks) refuses
    NumericDate claims that are not finite JSON numbers: PyJWT runs `int()` on them, so
    a string `"exp": "9999999999"` was accepted, and `true` read as 1."""

    def _decode_payload(self, decoded: dict[str, Any]) -> dict[str, Any]:
        payload = super()._decode_payload(decoded)
        for name in _NUMERIC_CLAIMS:
            if name not in payload:
                continue
            value = payload[name]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise _ClaimTypeError(
                    f"invalid token: claim {name!r} must be a number (got {_json_type(value)})"
                )
            if isinstance(value, float) and not math.isfinite(value):
                raise _ClaimTypeError(f"invalid token: claim {name!r} must be a finite number")
        return payload


def _json_type(value: object) -> str:
    """`value`'s JSON type with its article, for an error message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return f"a {type(value).__name__}"


_JWT = _StrictJWT()


class JwtVerifier:
    """Verifies JWTs against configured keys; see the module docstring for the rules."""

    _CACHE_SIZE = 4096

    def __init__(
        self,
        keys: Sequence[_JwtKey],
        *,
        issuer: str | None = None,
        audience: Sequence[str] = (),
        tenant_claim: str = "tenant",
        leeway_s: float = 0.0,
    ) -> None:
        if not keys:
            raise ConfigurationError("invalid jwt configuration: no verification key")
        self._unkeyed = [k for k in keys if k.kid is None]
        self._by_kid = {k.kid: k for k in keys if k.kid is not None}
        self.algorithms = frozenset().union(*(k.algorithms for k in keys))
        self._issuer = issuer
        self._audience = list(audience) or None
        self._tenant_claim = tenant_claim
        self._leeway = leeway_s
        self._cache: OrderedDict[bytes, tuple[Identity, float]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, config: ServerConfig) -> JwtVerifier:
        """Load the keys named by `config`. Raises `ConfigurationError`."""
        configured = config.jwt_algorithms
        keys: list[_JwtKey] = []
        secret: bytes | None = None
        if config.jwt_secret is not None:
            secret = config.jwt_secret.encode("utf-8")
        elif config.jwt_secret_file is not None:
            try:
                secret = config.jwt_secret_file.read_bytes().strip()
            except OSError as exc:
                raise ConfigurationError(
                    f"invalid jwt_secret_file: cannot read '{config.jwt_secret_file}': "
                    f"{exc.strerror}"
                ) from None
        if secret is not None:
            allowed = _allowed("hmac", configured, None)
            check_hmac_secret(secret, sorted(allowed))
            keys.append(_JwtKey(secret, allowed, None, "jwt_secret"))
        if config.jwt_public_key is not None:
            try:
                public = _load_pem_public_key(config.jwt_public_key)
                family = _public_key_family(public)
            except (OSError, ValueError, TypeError) as exc:
                raise ConfigurationError(
                    f"invalid jwt_public_key: '{config.jwt_public_key}': {exc}"
                ) from None
            allowed = _allowed(family, configured, None)
            if not allowed:
                raise ConfigurationError(
                    f"invalid jwt_algorithms: none of {', '.join(configured)} fits the "
                    f"{family} key in '{config.jwt_public_key}' "
                    f"(it verifies {', '.join(sorted(_FAMILY_ALGS[family]))})"
                )
            keys.append(_JwtKey(public, allowed, None, "jwt_public_key"))
        if config.jwt_jwks is not None:
            keys.extend(_load_jwks(config.jwt_jwks, configured))
        return cls(
            keys,
            issuer=config.jwt_issuer,
            audience=config.jwt_audience,
            tenant_claim=config.jwt_tenant_claim,
            leeway_s=config.jwt_leeway_s,
        )

    def _candidates(self, alg: str, kid: object) -> list[_JwtKey]:
        if kid is not None:
            if not isinstance(kid, str):
                raise AuthError("invalid token: malformed kid")
            if self._by_kid:
                key = self._by_kid.get(kid)
                if key is None:
                    raise AuthError("invalid token: unknown key id (kid)")
                keys = [key]
            else:
                keys = self._unkeyed
        else:
            keys = list(self._unkeyed)
            if len(self._by_kid) == 1:
                keys.extend(self._by_kid.values())
        return [k for k in keys if alg in k.algorithms]

    def verify(self, token: str) -> Identity:
        """The identity of a valid JWT, or `AuthError`."""
        cache_key = _digest(token)
        now = time.time()
        with self._lock:
            hit = self._cache.get(cache_key)
            if hit is not None:
                if now < hit[1]:
                    self._cache.move_to_end(cache_key)
                    return hit[0]
                del self._cache[cache_key]
        identity, exp = self._verify(token)
        with self._lock:
            self._cache[cache_key] = (identity, exp)
            while len(self._cache) > self._CACHE_SIZE:
                self._cache.popitem(last=False)
        return identity

    def _verify(self, token: str) -> tuple[Identity, float]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise AuthError("invalid token: malformed JWT") from None
        alg = header.get("alg")
        if not isinstance(alg, str) or alg not in self.algorithms:
            shown = alg if isinstance(alg, str) and len(alg) <= 16 else "?"
            raise AuthError(f"invalid token: JWT algorithm {shown!r} is not accepted")
        candidates = self._candidates(alg, header.get("kid"))
        if not candidates:
            raise AuthError(f"invalid token: no key verifies {alg} tokens")
        options: dict[str, Any] = {
            "require": ["exp"],
            "verify_signature": True,
            "verify_exp": True,
            "verify_nbf": True,
            "verify_iat": True,
            "verify_aud": self._audience is not None,
            "verify_iss": self._issuer is not None,
            "enforce_minimum_key_length": True,
        }
        if self._issuer is not None:
            options["require"].append("iss")
        if self._audience is not None:
            options["require"].append("aud")
        error: AuthError | None = None
        for candidate in candidates:
            try:
                claims = _JWT.decode(
                    token,
                    candidate.key,
                    algorithms=[alg],
                    options=options,  # type: ignore[arg-type]
                    audience=self._audience,
                    issuer=self._issuer,
                    leeway=self._leeway,
                )
            except jwt.InvalidSignatureError:
                error = AuthError("invalid token: bad signature")
                continue
            except jwt.PyJWTError as exc:
                raise AuthError(_describe(exc)) from None
            return self._identity(claims)
        raise error or AuthError("invalid token")

    def _identity(self, claims: dict[str, Any]) -> tuple[Identity, float]:
        claim = self._tenant_claim
        tenant = claims.get(claim)
        if tenant is None and claim != "sub":
            claim, tenant = "sub", claims.get("sub")
        if not isinstance(tenant, str):
            raise AuthError(f"invalid token: no string {self._tenant_claim!r} or 'sub' claim")
        try:
            check_tenant_name(tenant)
        except InvalidKeyError as exc:
            raise AuthError(
                f"invalid token: claim {claim!r} is not a valid tenant name: {exc}"
            ) from None
        subject = claims.get("sub")
        identity = Identity(
            tenant=tenant,
            subject=subject if isinstance(subject, str) else tenant,
            method="jwt",
        )
        return identity, float(claims["exp"])


_JWT_REASONS: tuple[tuple[type[Exception], str], ...] = (
    (jwt.ExpiredSignatureError, "expired"),
    (jwt.ImmatureSignatureError, "not yet valid"),
    (jwt.InvalidAudienceError, "wrong audience"),
    (jwt.InvalidIssuerError, "wrong issuer"),
    (jwt.InvalidAlgorithmError, "algorithm not accepted"),
    (jwt.InvalidKeyError, "key not usable for this algorithm"),
    (jwt.DecodeError, "malformed JWT"),
)
"""PyJWT's errors and what a rejection says; the first class that matches wins."""


def _describe(exc: Exception) -> str:
    """A short reason for a rejected JWT that never contains the token."""
    if isinstance(exc, _ClaimTypeError):
        return str(exc)
    if isinstance(exc, jwt.MissingRequiredClaimError):
        return f"invalid token: missing required claim {exc.claim!r}"
    for cls, reason in _JWT_REASONS:
        if isinstance(exc, cls):
            return f"invalid token: {reason}"
    return f"invalid token: {type(exc).__name__}"


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
            if not _write_generated_token(path, token):
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


def _write_generated_token(path: Path, token: str) -> bool:
    """Create `path` (0600) holding `token`; False if it exists already."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    except OSError as exc:
        raise ConfigurationError(
            f"invalid persist_dir: cannot create the first-run token '{path}': {exc.strerror}"
        ) from None
    try:
        os.write(fd, (token + "\n").encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


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

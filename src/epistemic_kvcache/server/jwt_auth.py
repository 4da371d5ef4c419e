"""Verified JWTs -> `Identity` (`JwtVerifier`): keys, pinned algorithms, strict claims.

How it works:
- The accepted algorithms are pinned by configuration; the token header's `alg` only
  selects among them and must match the family of the key it is checked with, so an
  RSA public key can never act as an HMAC secret (key confusion) and `none` is never
  accepted. Keys come from an HMAC secret, a PEM public key or a JWKS file (selected by
  `kid`, an unknown `kid` is refused).
- `exp` is required; `nbf`/`iat` are honoured; all three must be JSON numbers (a
  string `"exp": "9999999999"` is refused by name); `iss`/`aud` are enforced when
  configured. The tenant comes from the configured claim (default `tenant`, else
  `sub`) and passes `check_tenant_name` (server/tokens.py). Verified tokens are cached
  until their `exp`.

Error messages never contain the token.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jwt
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa

from epistemic_kvcache.config import JWT_ALGORITHMS, ServerConfig, check_hmac_secret
from epistemic_kvcache.errors import AuthError, ConfigurationError, InvalidKeyError
from epistemic_kvcache.server.context import Identity
from epistemic_kvcache.server.tokens import check_tenant_name, credential_digest

log = logging.getLogger("epistemic_kvcache.server.auth")

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


# -- keys ------------------------------------------------------------------------------


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
        cache_key = credential_digest(token)
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

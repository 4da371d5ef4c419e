"""Authentication: static tokens, token files, the first-run token and the JWT attack matrix."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import stat
import time
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

from epistemic_kvcache.config import load_config
from epistemic_kvcache.errors import AuthError, ConfigurationError
from epistemic_kvcache.server.auth import (
    CredentialAuthenticator,
    JwtVerifier,
    TokenTable,
    build_authenticator,
    ensure_generated_token,
    load_token_file,
    looks_like_jwt,
)
from helpers import eventually

SECRET = "s3cret-s3cret-s3cret-s3cret-0123456789"  # >= 32 bytes


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _forge(header: dict[str, Any], claims: dict[str, Any], sign: Any = None) -> str:
    """A JWT assembled by hand (PyJWT refuses to make the malicious ones)."""
    signing_input = f"{_b64(json.dumps(header).encode())}.{_b64(json.dumps(claims).encode())}"
    signature = sign(signing_input.encode()) if sign else b""
    return f"{signing_input}.{_b64(signature)}"


def _claims(**extra: Any) -> dict[str, Any]:
    now = int(time.time())
    out: dict[str, Any] = {"sub": "alice", "tenant": "tenant-a", "iat": now, "exp": now + 300}
    out.update(extra)
    return {k: v for k, v in out.items() if v is not None}


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def ec_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


@pytest.fixture
def rsa_pem(tmp_path: Path, rsa_key: rsa.RSAPrivateKey) -> Path:
    path = tmp_path / "jwt.pub.pem"
    path.write_bytes(
        rsa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return path


@pytest.fixture
def jwks(tmp_path: Path, ec_key: ec.EllipticCurvePrivateKey, rsa_key: rsa.RSAPrivateKey) -> Path:
    ec_jwk = json.loads(ECAlgorithm.to_jwk(ec_key.public_key()))
    ec_jwk.update(kid="ec-1", use="sig", alg="ES256")
    rsa_jwk = json.loads(RSAAlgorithm.to_jwk(rsa_key.public_key()))
    rsa_jwk.update(kid="rsa-1")
    path = tmp_path / "jwks.json"
    path.write_text(json.dumps({"keys": [ec_jwk, rsa_jwk]}))
    return path


def _auth(**cli: Any) -> CredentialAuthenticator:
    return build_authenticator(load_config(cli, {}))


# -- static tokens ---------------------------------------------------------------------


def test_static_token_maps_to_default_tenant() -> None:
    auth = _auth(token=["first-token-0123456", "second-token-0123456"])
    for token in ("first-token-0123456", "second-token-0123456"):
        ident = auth.authenticate(token)
        assert (ident.tenant, ident.method) == ("default", "token")


@pytest.mark.parametrize(
    "credential", ["", "first-token-012345", "first-token-01234567", "FIRST-TOKEN-0123456", " "]
)
def test_wrong_tokens_refused_without_echo(credential: str) -> None:
    auth = _auth(token=["first-token-0123456"])
    with pytest.raises(AuthError) as info:
        auth.authenticate(credential)
    assert "first-token" not in str(info.value)
    if credential.strip():
        assert credential not in str(info.value)


def test_token_table_checks_every_entry() -> None:
    table = TokenTable([("a" * 20, "t1"), ("b" * 20, "t2"), ("c" * 20, "t3")])
    assert table.lookup("c" * 20) == "t3"
    assert table.lookup("a" * 20) == "t1"
    assert table.lookup("d" * 20) is None
    assert len(table) == 3


def test_token_file_tenants(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text(
        "# comment\n\ntok-alpha-0123456789 tenant-a\ntok-beta-0123456789   tenant-b\n"
        "tok-plain-0123456789\n"
    )
    path.chmod(0o600)
    auth = _auth(token_file=str(path))
    assert auth.authenticate("tok-alpha-0123456789").tenant == "tenant-a"
    assert auth.authenticate("tok-beta-0123456789").tenant == "tenant-b"
    assert auth.authenticate("tok-plain-0123456789").tenant == "default"
    with pytest.raises(AuthError):
        auth.authenticate("tenant-a")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("tok-0123456789abcdef a b\n", "expected 'token [tenant]'"),
        ("# only comments\n", "holds no token"),
        ("tok-0123456789abcdef a\ntok-0123456789abcdef b\n", "tenants 'a' and 'b'"),
        ("tok-0123456789abcdef " + "x" * 300 + "\n", "invalid tenant"),
        # garbage that used to load as one token ('\x00\xff' for tenant 'garbage')
        ("\x00\xff garbage \n", "line 1: control character U+0000"),
        ("tok-0123456789abcdef a\n# \x1b[2J\n", "line 2: control character U+001B"),
        ("tok-0123456789abcdef\x7f a\n", "line 1: control character U+007F"),
        ("tok-0123456789abcdef\u2028x a\n", "line 1: control character U+2028"),
        ("tok-0123456789abcdéf a\n", "expected visible ASCII characters only"),
        ("\ufefftok-0123456789abcdef a\n", "expected visible ASCII characters only"),
        (b"tok-0123456789abcdef a\n\xff\xfe\n", "not UTF-8 text (invalid byte at offset 23)"),
    ],
)
def test_token_file_errors(tmp_path: Path, content: str | bytes, message: str) -> None:
    path = tmp_path / "tokens"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    path.chmod(0o600)
    with pytest.raises(ConfigurationError, match=re.escape(message)) as info:
        load_token_file(path)
    assert "tok-0123456789abcdef" not in str(info.value)


def test_token_table_refuses_tokens_no_client_can_send() -> None:
    table = TokenTable()
    for bad in ("tok\x00-0123456789abcdef", "tök-0123456789abcdef", "tok-0123456789\x7fabcdef"):
        with pytest.raises(ConfigurationError, match="visible ASCII characters only"):
            table.add(bad, "default")
    assert len(table) == 0
    table.add("!~tok-0123456789abcdef", "default")  # every visible ASCII character is fine
    assert table.lookup("!~tok-0123456789abcdef") == "default"


def test_world_writable_token_file_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("tok-0123456789abcdef\n")
    path.chmod(0o666)
    with pytest.raises(ConfigurationError, match="world-writable"):
        load_token_file(path)


def test_world_readable_token_file_warns(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "tokens"
    path.write_text("tok-0123456789abcdef\n")
    path.chmod(0o644)
    assert load_token_file(path).lookup("tok-0123456789abcdef") == "default"
    assert "readable by group/others" in caplog.text


def test_first_run_token_generated_0600_and_reused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    persist = tmp_path / "data"
    caplog.set_level("INFO")
    auth = _auth(persist_dir=str(persist))
    token_path = persist / "token"
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    token = token_path.read_text().strip()
    assert len(token) >= 32
    assert auth.authenticate(token).tenant == "default"
    assert str(token_path.resolve()) in caplog.text
    assert token not in caplog.text
    # Second start: same token.
    auth2 = _auth(persist_dir=str(persist))
    assert token_path.read_text().strip() == token
    assert auth2.authenticate(token).tenant == "default"
    assert ensure_generated_token(persist) == token_path


def test_no_token_generated_when_auth_configured(tmp_path: Path) -> None:
    _auth(persist_dir=str(tmp_path), token=["configured-token-0123"])
    assert not (tmp_path / "token").exists()


def test_fail_closed_without_credentials(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="refusing to serve"):
        _auth(persist_dir=str(tmp_path), generate_token="false")
    assert not (tmp_path / "token").exists()
    with pytest.raises(ConfigurationError, match="fail closed"):
        CredentialAuthenticator(TokenTable(), None)


def test_looks_like_jwt() -> None:
    assert looks_like_jwt("eyJhbGciOi.eyJzdWIi.c2ln")
    assert looks_like_jwt("a.b.")
    assert not looks_like_jwt("plain-token")
    assert not looks_like_jwt("a.b.c.d")
    assert not looks_like_jwt("a b.c.d")


def test_jwt_shaped_static_token_without_jwt_config() -> None:
    auth = _auth(token=["abc.def.ghi-0123456789"])
    assert auth.authenticate("abc.def.ghi-0123456789").method == "token"


def test_jwt_shaped_credential_goes_to_jwt_when_configured() -> None:
    auth = _auth(token=["abc.def.ghi-0123456789"], jwt_secret=SECRET)
    with pytest.raises(AuthError, match="malformed JWT"):
        auth.authenticate("abc.def.ghi-0123456789")
    hs = jwt.encode(_claims(), SECRET, algorithm="HS256")
    assert auth.authenticate(hs).method == "jwt"


# -- JWT: accepted ---------------------------------------------------------------------


def test_hs256_accepted() -> None:
    auth = _auth(jwt_secret=SECRET)
    ident = auth.authenticate(jwt.encode(_claims(), SECRET, algorithm="HS256"))
    assert (ident.tenant, ident.subject, ident.method) == ("tenant-a", "alice", "jwt")


def test_rs256_from_pem_accepted(rsa_pem: Path, rsa_key: rsa.RSAPrivateKey) -> None:
    auth = _auth(jwt_public_key=str(rsa_pem), jwt_issuer="issuer-x", jwt_audience="kv,other")
    token = jwt.encode(_claims(iss="issuer-x", aud="kv"), rsa_key, algorithm="RS256")
    assert auth.authenticate(token).tenant == "tenant-a"
    # Cached path gives the same answer.
    assert auth.authenticate(token).tenant == "tenant-a"


def test_es256_from_jwks_accepted(jwks: Path, ec_key: ec.EllipticCurvePrivateKey) -> None:
    auth = _auth(jwt_jwks=str(jwks))
    token = jwt.encode(_claims(), ec_key, algorithm="ES256", headers={"kid": "ec-1"})
    assert auth.authenticate(token).tenant == "tenant-a"


def test_jwks_rsa_key_by_kid(jwks: Path, rsa_key: rsa.RSAPrivateKey) -> None:
    auth = _auth(jwt_jwks=str(jwks))
    token = jwt.encode(_claims(), rsa_key, algorithm="RS256", headers={"kid": "rsa-1"})
    assert auth.authenticate(token).tenant == "tenant-a"


def test_tenant_claim_and_sub_fallback() -> None:
    auth = _auth(jwt_secret=SECRET)
    no_tenant = jwt.encode(_claims(tenant=None, sub="bob"), SECRET, algorithm="HS256")
    assert auth.authenticate(no_tenant).tenant == "bob"
    custom = _auth(jwt_secret=SECRET, jwt_tenant_claim="org")
    token = jwt.encode(_claims(org="org-7"), SECRET, algorithm="HS256")
    assert custom.authenticate(token).tenant == "org-7"
    assert custom.authenticate(token).subject == "alice"


def test_bad_tenant_claim_refused() -> None:
    auth = _auth(jwt_secret=SECRET)
    for claims in (_claims(tenant=None, sub=None), _claims(tenant=5), _claims(tenant="x\x00y")):
        with pytest.raises(AuthError):
            auth.authenticate(jwt.encode(claims, SECRET, algorithm="HS256"))


@pytest.mark.parametrize(
    ("tenant", "where"),
    [
        ("t\r\n2026-01-01 00:00:00,000 INFO forged", "U+000D at index 1"),
        ("team\nb", "U+000A at index 4"),
        ("\x1b[31mred", "U+001B at index 0"),
        ("tab\there", "U+0009 at index 3"),
        ("a\x7fb", "U+007F at index 1"),
        ("a\x85b", "U+0085 at index 1"),
        ("a\u2028b", "U+2028 at index 1"),
    ],
)
def test_control_characters_in_a_tenant_claim_refused(tenant: str, where: str) -> None:
    """Issue 23: a tenant claim with CR/LF wrote forged lines into the text log. Refused
    at verification, saying which character and where (never echoing the claim)."""
    auth = _auth(jwt_secret=SECRET)
    for claims in (_claims(tenant=tenant), _claims(tenant=None, sub=tenant)):
        token = jwt.encode(claims, SECRET, algorithm="HS256")
        with pytest.raises(AuthError) as info:
            auth.authenticate(token)
        claim = "tenant" if claims.get("tenant") else "sub"
        assert str(info.value) == (
            f"invalid token: claim {claim!r} is not a valid tenant name: control character "
            f"{where} (tenant names may not hold control characters or line breaks)"
        )
    ok = jwt.encode(_claims(tenant="t\u00e9am-\u00fc\\x0d"), SECRET, algorithm="HS256")
    assert auth.authenticate(ok).tenant == "t\u00e9am-\u00fc\\x0d"  # printable: fine


def test_control_characters_in_a_configured_tenant_refused() -> None:
    with pytest.raises(ConfigurationError, match=r"invalid tenant in --token: control char"):
        TokenTable([("tok-0123456789abcdef", "a\x1bb")])


@pytest.mark.parametrize(
    ("claim", "value", "message"),
    [
        ("exp", "9999999999", "claim 'exp' must be a number (got a string)"),
        ("exp", True, "claim 'exp' must be a number (got a boolean)"),
        ("exp", None, "claim 'exp' must be a number (got null)"),
        ("exp", [9999999999], "claim 'exp' must be a number (got an array)"),
        ("exp", float("inf"), "claim 'exp' must be a finite number"),
        ("nbf", "0", "claim 'nbf' must be a number (got a string)"),
        ("iat", "0", "claim 'iat' must be a number (got a string)"),
        ("iat", {"t": 0}, "claim 'iat' must be a number (got an object)"),
    ],
)
def test_registered_time_claims_must_be_numbers(claim: str, value: Any, message: str) -> None:
    """Signed with the right key, but a NumericDate claim of another JSON type: refused
    with the claim's name (PyJWT alone ran `int()` on it: `"exp": "9999999999"` passed)."""
    auth = _auth(jwt_secret=SECRET)
    claims = _claims()
    claims[claim] = value
    token = _forge(
        {"alg": "HS256", "typ": "JWT"},
        claims,
        lambda data: hmac.new(SECRET.encode(), data, hashlib.sha256).digest(),
    )
    with pytest.raises(AuthError, match=re.escape(message)):
        auth.authenticate(token)
    ok = jwt.encode(_claims(exp=time.time() + 300.5, nbf=1.5), SECRET, algorithm="HS256")
    assert auth.authenticate(ok).tenant == "tenant-a"  # floats are numbers


# -- JWT: the attack matrix ------------------------------------------------------------


def _attack_cases(
    rsa_key: rsa.RSAPrivateKey, rsa_pem: Path, ec_key: ec.EllipticCurvePrivateKey
) -> dict[str, tuple[str, str]]:
    """name -> (token, expected message fragment), against an RS256 PEM server."""
    now = int(time.time())
    pem = rsa_pem.read_bytes()
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def hs256_with(secret: bytes) -> Any:
        return lambda data: hmac.new(secret, data, hashlib.sha256).digest()

    good = jwt.encode(_claims(iss="iss", aud="kv"), rsa_key, algorithm="RS256")
    head, _body, sig = good.split(".")
    tampered_body = _b64(json.dumps(_claims(iss="iss", aud="kv", tenant="victim")).encode())
    return {
        "alg_none": (_forge({"alg": "none", "typ": "JWT"}, _claims(iss="iss", aud="kv")), "'none'"),
        "alg_none_caps": (_forge({"alg": "NONE"}, _claims(iss="iss", aud="kv")), "not accepted"),
        "key_confusion_hs256_with_public_pem": (
            _forge({"alg": "HS256", "typ": "JWT"}, _claims(iss="iss", aud="kv"), hs256_with(pem)),
            "'HS256' is not accepted",
        ),
        "expired": (
            jwt.encode(
                _claims(iss="iss", aud="kv", exp=now - 10, iat=now - 100),
                rsa_key,
                algorithm="RS256",
            ),
            "expired",
        ),
        "not_yet_valid_nbf": (
            jwt.encode(_claims(iss="iss", aud="kv", nbf=now + 100), rsa_key, algorithm="RS256"),
            "not yet valid",
        ),
        "issued_in_future": (
            jwt.encode(_claims(iss="iss", aud="kv", iat=now + 100), rsa_key, algorithm="RS256"),
            "not yet valid",
        ),
        "wrong_aud": (
            jwt.encode(_claims(iss="iss", aud="someone-else"), rsa_key, algorithm="RS256"),
            "wrong audience",
        ),
        "missing_aud": (
            jwt.encode(_claims(iss="iss"), rsa_key, algorithm="RS256"),
            "'aud'",
        ),
        "wrong_iss": (
            jwt.encode(_claims(iss="evil", aud="kv"), rsa_key, algorithm="RS256"),
            "wrong issuer",
        ),
        "missing_exp": (
            jwt.encode(_claims(iss="iss", aud="kv", exp=None), rsa_key, algorithm="RS256"),
            "'exp'",
        ),
        "bad_signature_other_key": (
            jwt.encode(_claims(iss="iss", aud="kv"), other, algorithm="RS256"),
            "bad signature",
        ),
        "bad_signature_tampered_claims": (f"{head}.{tampered_body}.{sig}", "bad signature"),
        "wrong_algorithm_ps256": (
            jwt.encode(_claims(iss="iss", aud="kv"), rsa_key, algorithm="PS256"),
            "'PS256' is not accepted",
        ),
        "wrong_algorithm_es256": (
            jwt.encode(_claims(iss="iss", aud="kv"), ec_key, algorithm="ES256"),
            "'ES256' is not accepted",
        ),
        "garbage": ("abc.def.ghi", "malformed"),
    }


def test_jwt_attack_matrix(
    rsa_key: rsa.RSAPrivateKey, rsa_pem: Path, ec_key: ec.EllipticCurvePrivateKey
) -> None:
    auth = _auth(
        jwt_public_key=str(rsa_pem),
        jwt_algorithms="RS256",
        jwt_issuer="iss",
        jwt_audience="kv",
    )
    good = jwt.encode(_claims(iss="iss", aud="kv"), rsa_key, algorithm="RS256")
    assert auth.authenticate(good).tenant == "tenant-a"
    cases = _attack_cases(rsa_key, rsa_pem, ec_key)
    for name, (token, fragment) in cases.items():
        with pytest.raises(AuthError) as info:
            auth.authenticate(token)
        message = str(info.value)
        assert fragment in message, (name, message)
        assert token not in message, name
        assert "eyJ" not in message, name


def test_key_confusion_with_secret_and_public_key_configured(
    rsa_key: rsa.RSAPrivateKey, rsa_pem: Path
) -> None:
    """Both HS256 (secret) and RS256 (PEM) accepted: the PEM still never acts as a secret."""
    auth = _auth(jwt_secret=SECRET, jwt_public_key=str(rsa_pem), jwt_algorithms="HS256,RS256")
    pem = rsa_pem.read_bytes()
    forged = _forge(
        {"alg": "HS256"}, _claims(), lambda data: hmac.new(pem, data, hashlib.sha256).digest()
    )
    with pytest.raises(AuthError, match="bad signature"):
        auth.authenticate(forged)
    assert auth.authenticate(jwt.encode(_claims(), SECRET, algorithm="HS256")).method == "jwt"
    assert auth.authenticate(jwt.encode(_claims(), rsa_key, algorithm="RS256")).method == "jwt"


def test_unknown_kid_refused(jwks: Path, ec_key: ec.EllipticCurvePrivateKey) -> None:
    auth = _auth(jwt_jwks=str(jwks))
    token = jwt.encode(_claims(), ec_key, algorithm="ES256", headers={"kid": "nope"})
    with pytest.raises(AuthError, match="unknown key id"):
        auth.authenticate(token)
    # No kid with several JWKS keys: nothing to select.
    token = jwt.encode(_claims(), ec_key, algorithm="ES256")
    with pytest.raises(AuthError, match="no key verifies"):
        auth.authenticate(token)


def test_kid_of_the_wrong_key_type_refused(jwks: Path, ec_key: ec.EllipticCurvePrivateKey) -> None:
    auth = _auth(jwt_jwks=str(jwks))
    token = jwt.encode(_claims(), ec_key, algorithm="ES256", headers={"kid": "rsa-1"})
    with pytest.raises(AuthError, match="no key verifies ES256"):
        auth.authenticate(token)


def test_hs256_wrong_secret_refused() -> None:
    auth = _auth(jwt_secret=SECRET)
    token = jwt.encode(_claims(), "x" * 40, algorithm="HS256")
    with pytest.raises(AuthError, match="bad signature"):
        auth.authenticate(token)
    with pytest.raises(AuthError, match="'HS512' is not accepted"):
        auth.authenticate(jwt.encode(_claims(), "y" * 64, algorithm="HS512"))


def test_cached_token_still_expires() -> None:
    auth = _auth(jwt_secret=SECRET)
    # 2 to 3 s of validity (exp is whole seconds: `+ 1` left as little as a millisecond
    # for the first, uncached, check)
    token = jwt.encode(_claims(exp=int(time.time()) + 3), SECRET, algorithm="HS256")
    assert auth.authenticate(token).tenant == "tenant-a"

    def refused() -> str:  # real time: PyJWT checks `exp` against the wall clock too
        try:
            auth.authenticate(token)
        except AuthError as exc:
            return str(exc)
        return ""

    assert "expired" in eventually(refused, timeout=10, what="the cached token expires")


def test_leeway_honoured() -> None:
    now = int(time.time())
    token = jwt.encode(_claims(exp=now - 5, iat=now - 60), SECRET, algorithm="HS256")
    with pytest.raises(AuthError, match="expired"):
        _auth(jwt_secret=SECRET).authenticate(token)
    assert _auth(jwt_secret=SECRET, jwt_leeway_s="30").authenticate(token).tenant == "tenant-a"


# -- JWT configuration errors ----------------------------------------------------------


def test_algorithms_must_fit_the_key(rsa_pem: Path) -> None:
    with pytest.raises(ConfigurationError, match="fits the rsa key"):
        _auth(jwt_public_key=str(rsa_pem), jwt_algorithms="ES256")


def test_private_key_pem_refused(tmp_path: Path, ec_key: ec.EllipticCurvePrivateKey) -> None:
    path = tmp_path / "private.pem"
    path.write_bytes(
        ec_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    with pytest.raises(ConfigurationError, match="private key"):
        _auth(jwt_public_key=str(path))


def test_weak_rsa_key_refused(tmp_path: Path) -> None:
    weak = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    path = tmp_path / "weak.pem"
    path.write_bytes(
        weak.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    with pytest.raises(ConfigurationError, match="1024 bits"):
        _auth(jwt_public_key=str(path))


def test_secret_file_and_short_secret(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("short-secret\n")
    with pytest.raises(ConfigurationError, match=r"at least 32 bytes \(got 12 bytes\)") as info:
        _auth(jwt_secret_file=str(path))
    assert "short-secret" not in str(info.value)
    path.write_text(SECRET + "\n")
    auth = _auth(jwt_secret_file=str(path))
    assert auth.authenticate(jwt.encode(_claims(), SECRET, algorithm="HS256")).tenant == "tenant-a"


def test_jwks_errors(tmp_path: Path, ec_key: ec.EllipticCurvePrivateKey) -> None:
    path = tmp_path / "jwks.json"
    public = json.loads(ECAlgorithm.to_jwk(ec_key.public_key()))
    private = json.loads(ECAlgorithm.to_jwk(ec_key))
    cases = [
        ("[]", "no 'keys' array"),
        (json.dumps({"keys": [public]}), "has no 'kid'"),
        (json.dumps({"keys": [dict(private, kid="a")]}), "private key material"),
        (json.dumps({"keys": [{"kty": "oct", "k": "abc", "kid": "h"}]}), "symmetric"),
        (json.dumps({"keys": [dict(public, kid="a"), dict(public, kid="a")]}), "duplicate kid"),
        (json.dumps({"keys": [dict(public, kid="a", use="enc")]}), "no usable signing key"),
        ("{not json", "cannot read"),
    ]
    for content, message in cases:
        path.write_text(content)
        with pytest.raises(ConfigurationError, match=message):
            _auth(jwt_jwks=str(path))


def test_verifier_needs_a_key() -> None:
    with pytest.raises(ConfigurationError):
        JwtVerifier([])


def test_generated_token_file_mode_survives_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        path = ensure_generated_token(tmp_path / "d")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600

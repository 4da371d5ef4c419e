"""Static bearer tokens: the token table, the token file, the first-run token.

How it works:
- Every accepted token is kept as its SHA-256 digest with its tenant
  (`TokenTable`). A credential is hashed once and compared with `hmac.compare_digest`
  against *every* entry (no early exit), so neither timing nor length reveals which
  token, if any, matched.
- A token file holds `token [tenant]` lines (`load_token_file`); one that is
  world-writable, not text, or holds no valid token is refused whole, so a reload of a
  damaged file keeps the credentials in force. The first-run token is written once,
  mode 0600, and never overwritten (`write_generated_token`).
- `check_tenant_name` is the rule every tenant name passes, whether it comes from a
  token file or a JWT claim (server/jwt_auth.py).

Error messages never contain the credential.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterable
from pathlib import Path

from epistemic_kvcache.config import DEFAULT_TENANT
from epistemic_kvcache.errors import ConfigurationError, InvalidKeyError
from epistemic_kvcache.server.oplog import UNSAFE_TEXT
from epistemic_kvcache.shared import validate_namespace

log = logging.getLogger("epistemic_kvcache.server.auth")

GENERATED_TOKEN_FILENAME = "token"  # noqa: S105 - a file name, not a secret

_VISIBLE_ASCII = re.compile(r"[!-~]+")
# Refused anywhere in a token file: control characters (C0, DEL, C1) other than tab, CR
# and LF, and the Unicode line separators (`splitlines` would split a line on them).
_FILE_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u2028\u2029]")


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


def credential_digest(value: str) -> bytes:
    """SHA-256 of a credential: what the token table keeps and the JWT cache is keyed by."""
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
        digest = credential_digest(token)
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
        candidate = credential_digest(credential)
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
    write_generated_token(path, secrets.token_urlsafe(32))
    return path


def write_generated_token(path: Path, token: str) -> bool:
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

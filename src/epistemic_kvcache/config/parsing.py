"""Parsers of raw setting values: (raw value) -> value, or `InvalidValue` saying what was
expected (`load_config` adds the setting, the value and where it was set)."""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable
from pathlib import Path

from epistemic_kvcache.config.schema import JWT_ALGORITHMS, Address
from epistemic_kvcache.shared import (
    GiB,
    KiB,
    MiB,
    TiB,
)

# -- parsers: (setting name, raw value) -> value; raise ConfigurationError ----------------


class InvalidValue(Exception):
    """Internal: a parser rejects a value; `load_config` adds name, value and source."""

    def __init__(self, expected: str, *, show_value: bool = True) -> None:
        super().__init__(expected)
        self.expected = expected
        self.show_value = show_value


_SIZE_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_SIZE_UNITS = {
    # redis.conf's units: a bare letter is a power of 1000, the letter and `b` a power
    # of 1024 (`4gb` is 4 GiB, `4g` 4 * 10**9); IEC names are powers of 1024 too
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": KiB,
    "ki": KiB,
    "kib": KiB,
    "m": 1000**2,
    "mb": MiB,
    "mi": MiB,
    "mib": MiB,
    "g": 1000**3,
    "gb": GiB,
    "gi": GiB,
    "gib": GiB,
    "t": 1000**4,
    "tb": TiB,
    "ti": TiB,
    "tib": TiB,
}


def parse_size(raw: object) -> int:
    """`4GiB`, `512MiB`, `4gb` (= 4GiB, as in redis.conf), `1G` (10**9), `1.5GiB`,
    `1048576` -> bytes; units are case-insensitive. Must be > 0."""
    expected = "a positive size like 4GiB"
    if isinstance(raw, bool):
        raise InvalidValue(expected)
    if isinstance(raw, int):
        value = raw
    else:
        m = _SIZE_RE.match(str(raw))
        if m is None or m.group(2).lower() not in _SIZE_UNITS:
            raise InvalidValue(expected)
        number = float(m.group(1).replace("_", ""))
        value = math.floor(number * _SIZE_UNITS[m.group(2).lower()])
    if value <= 0:
        raise InvalidValue(expected)
    return value


def parse_size_or_zero(raw: object) -> int:
    """Like `parse_size`, but 0 is allowed (it turns a RAM tier off)."""
    if raw == 0 or (isinstance(raw, str) and raw.strip() in ("0", "0B", "0b")):
        return 0
    try:
        return parse_size(raw)
    except InvalidValue:
        raise InvalidValue("a size like 4GiB, or 0 to turn the tier off") from None


def _parse_int(raw: object, *, minimum: int, expected: str) -> int:
    if isinstance(raw, bool):
        raise InvalidValue(expected)
    if isinstance(raw, int):
        value = raw
    else:
        try:
            value = int(str(raw).strip().replace("_", ""))
        except ValueError:
            raise InvalidValue(expected) from None
    if value < minimum:
        raise InvalidValue(expected)
    return value


def parse_positive_int(raw: object) -> int:
    return _parse_int(raw, minimum=1, expected="a positive integer")


def parse_nonneg_int(raw: object) -> int:
    return _parse_int(raw, minimum=0, expected="a non-negative integer")


def _parse_float(raw: object, valid: Callable[[float], bool], expected: str) -> float:
    """A finite number for which `valid` holds, else `InvalidValue(expected)`."""
    if isinstance(raw, bool):
        raise InvalidValue(expected)
    try:
        value = float(raw) if isinstance(raw, int | float) else float(str(raw).strip())
    except ValueError:
        raise InvalidValue(expected) from None
    if not math.isfinite(value) or not valid(value):
        raise InvalidValue(expected)
    return value


def parse_fraction(raw: object) -> float:
    return _parse_float(raw, lambda v: 0 < v <= 1, "a fraction in (0, 1], e.g. 0.5")


def nonneg_seconds(raw: object) -> float:
    return _parse_float(raw, lambda v: v >= 0, "a number of seconds >= 0")


def pos_seconds(raw: object) -> float:
    return _parse_float(raw, lambda v: v > 0, "a number of seconds > 0")


def parse_address(raw: object) -> Address:
    """`host:port` or `[v6]:port`; port 0 asks the OS for a free port."""
    expected = "host:port, e.g. 127.0.0.1:9130 or [::1]:9130"
    if not isinstance(raw, str):
        raise InvalidValue(expected)
    text = raw.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise InvalidValue(expected)
        port_text = rest[1:]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidValue(expected) from None
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep or not host or ":" in host:
            raise InvalidValue(expected)
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise InvalidValue(expected + ", port 0..65535")
    if not re.fullmatch(r"[A-Za-z0-9._:%-]+", host):
        raise InvalidValue(expected)
    return Address(host, int(port_text))


def parse_address_or_off(raw: object) -> Address | None:
    if isinstance(raw, str) and raw.strip().lower() in ("off", "none", "disabled"):
        return None
    if raw is False:
        return None
    try:
        return parse_address(raw)
    except InvalidValue:
        raise InvalidValue("host:port (e.g. 127.0.0.1:6379) or 'off'") from None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(raw: object) -> bool:
    """true/false, 1/0, yes/no, on/off (case-insensitive); TOML booleans."""
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise InvalidValue("a boolean (true/false, 1/0, yes/no, on/off)")


def choice(*options: str) -> Callable[[object], str]:
    def parse(raw: object) -> str:
        text = str(raw).strip().lower() if isinstance(raw, str) else None
        if text not in options:
            raise InvalidValue("one of " + ", ".join(options))
        return text

    return parse


def parse_log_level(raw: object) -> str:
    levels = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    text = str(raw).strip().upper() if isinstance(raw, str) else ""
    if text == "WARN":
        text = "WARNING"
    if text not in levels:
        raise InvalidValue("one of " + ", ".join(level.lower() for level in levels))
    return text


def parse_path(raw: object) -> Path:
    if not isinstance(raw, str | Path) or not str(raw).strip():
        raise InvalidValue("a file system path")
    return Path(str(raw).strip()).expanduser()


def parse_optional_text(raw: object) -> str | None:
    if not isinstance(raw, str):
        raise InvalidValue("a string")
    return raw.strip() or None


def parse_cluster_url(raw: object) -> str | None:
    if not isinstance(raw, str):
        raise InvalidValue("a redis:// or rediss:// URL", show_value=False)
    text = raw.strip()
    if not text:
        return None
    if not text.startswith(("redis://", "rediss://")):
        raise InvalidValue(
            "a redis://host:port[,host:port...] or rediss://... URL", show_value=False
        )
    return text


def parse_key_prefix(raw: object) -> str:
    if not isinstance(raw, str) or not raw.strip() or any(c in raw.strip() for c in "{}: "):
        raise InvalidValue("a word without braces, colons or spaces")
    return raw.strip()


def parse_claim(raw: object) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise InvalidValue("a claim name")
    return raw.strip()


def parse_list(raw: object) -> tuple[str, ...]:
    """A comma-separated string, or a TOML array / repeated flag of strings."""
    items: list[object]
    if isinstance(raw, str):
        items = list(raw.split(","))
    elif isinstance(raw, list | tuple):
        items = []
        for item in raw:
            items.extend(item.split(",") if isinstance(item, str) else [item])
    else:
        raise InvalidValue("a comma-separated list")
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise InvalidValue("a comma-separated list of strings")
        if item.strip() and item.strip() not in out:
            out.append(item.strip())
    return tuple(out)


def parse_algorithms(raw: object) -> tuple[str, ...]:
    algs = parse_list(raw)
    canonical = {a.lower(): a for a in JWT_ALGORITHMS}
    out = []
    for alg in algs:
        if alg.lower() == "none":
            raise InvalidValue("signing algorithms; 'none' is never accepted")
        if alg.lower() not in canonical:
            raise InvalidValue("algorithms among " + ", ".join(JWT_ALGORITHMS))
        out.append(canonical[alg.lower()])
    return tuple(out)


def parse_tokens(raw: object) -> tuple[str, ...]:
    """`--token` (repeatable) / TOML string or array / env: one token."""
    items = raw if isinstance(raw, list | tuple) else [raw]
    out: list[str] = []
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise InvalidValue("a non-empty token string", show_value=False)
        token = item.strip()
        if any(c.isspace() for c in token):
            raise InvalidValue("a token without whitespace", show_value=False)
        if token not in out:
            out.append(token)
    return tuple(out)


def parse_secret(raw: object) -> str | None:
    if not isinstance(raw, str):
        raise InvalidValue("a string", show_value=False)
    return raw.strip() or None


def format_size(n: int) -> str:
    """Bytes as the largest exact binary unit: 1073741824 -> `1GiB`."""
    for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= factor and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)

"""`load_config`: every setting resolved flag > environment > TOML file > default, then
checked; and the effective settings as `config show` prints them."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from epistemic_kvcache.config.checks import resource_warnings, validate
from epistemic_kvcache.config.parsing import InvalidValue, format_size
from epistemic_kvcache.config.schema import (
    CLIENT_ENV_NAMES,
    CLIENT_ENV_PREFIX,
    CONFIG_FILE_ENV,
    ENV_PREFIX,
    Address,
    ServerConfig,
)
from epistemic_kvcache.config.settings import (
    LIMIT_NAMES,
    RENAMED,
    SETTINGS,
    SETTINGS_BY_NAME,
    STORE_NAMES,
    Setting,
)
from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.options import StoreOptions, first_write_wins_of
from epistemic_kvcache.shared import (
    ServerLimits,
)
from epistemic_kvcache.twins import PURE_BUILD_ENV, PURE_PYTHON_ENV, TWIN_NAMES


def _twin_warnings(value: str) -> list[str]:
    """What is wrong with a `PURE_PYTHON_ENV` value: names that are no twin's."""
    names = {n.strip() for n in value.split(",")} - {"", "0", "1"}
    unknown = sorted(names - set(TWIN_NAMES))
    if not unknown:
        return []
    effect = "ignored" if names & set(TWIN_NAMES) else "every twin runs pure, as for 1"
    return [
        f"{PURE_PYTHON_ENV}: unknown twin name(s) {', '.join(unknown)} ({effect}; the "
        f"twins are {', '.join(TWIN_NAMES)})"
    ]


def load_config(
    cli: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    *,
    config_file: str | Path | None = None,
    file_checks: bool = True,
) -> ServerConfig:
    """Resolve every setting: flag > environment > TOML file > default, then validate.

    `cli` maps setting names to raw flag values (`vars()` of a parser built with
    `add_arguments`; a `config` entry names the TOML file). `env` defaults to
    `os.environ`. Raises `ConfigurationError` naming the setting and the value.
    `file_checks=False`: nothing is checked against this machine (files the settings
    name, its memory and disk), for a configuration meant for another machine
    (`config show --no-file-checks`); every value and cross-setting rule still is.
    """
    cli = dict(cli or {})
    env = os.environ if env is None else env
    warnings: list[str] = []

    file_source = cli.pop("config", None) or config_file or env.get(CONFIG_FILE_ENV) or None
    toml_values: dict[str, Any] = {}
    toml_path: Path | None = None
    if file_source is not None:
        toml_path = Path(str(file_source)).expanduser()
        toml_values = _read_toml(toml_path)

    unknown_cli = set(cli) - set(SETTINGS_BY_NAME)
    if unknown_cli:
        raise ConfigurationError(f"unknown settings: {', '.join(sorted(unknown_cli))}")

    known_env = {name for s in SETTINGS for name in s.env_names} | {CONFIG_FILE_ENV}
    known_env.add(PURE_PYTHON_ENV)  # read by twins.py (docs/configuration.md)
    known_env.add(PURE_BUILD_ENV)  # read by setup.py when the package is built
    warnings += _twin_warnings(env.get(PURE_PYTHON_ENV, ""))
    all_names = sorted(s.env for s in SETTINGS)
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or name in known_env:
            continue
        if name.startswith(CLIENT_ENV_PREFIX) or name in CLIENT_ENV_NAMES:
            continue
        hint = difflib.get_close_matches(name, all_names, n=1)
        warnings.append(
            f"unknown environment variable {name} ignored"
            + (f" (did you mean {hint[0]}?)" if hint else "")
        )

    values: dict[str, Any] = {}
    explicit: set[str] = set()
    origins: list[tuple[str, str]] = []
    overridden: dict[str, str] = {}
    for s in SETTINGS:
        raw: Any
        if s.name in cli:
            raw, source, from_toml = cli[s.name], s.flag, False
            origins.append((s.name, f"flag {s.flag}"))
        elif (env_name := next((n for n in s.env_names if env.get(n, "") != ""), None)) is not None:
            raw, source, from_toml = env[env_name], f"environment {env_name}", False
            origins.append((s.name, f"env {env_name}"))
        elif s.name in toml_values:
            raw, source, from_toml = toml_values[s.name], f"{toml_path} key {s.name}", True
            origins.append((s.name, f"file {toml_path}"))
        else:
            values[s.name] = s.default
            origins.append((s.name, "default"))
            continue
        try:
            value = s.parse(raw)
        except InvalidValue as exc:
            shown = f"got {raw!r}" if exc.show_value else "value not shown"
            raise ConfigurationError(
                f"invalid {s.name}: expected {exc.expected} ({shown}); set by {source}"
            ) from None
        if s.path_like and from_toml and toml_path is not None and not value.is_absolute():
            value = toml_path.parent / value
        values[s.name] = value
        explicit.add(s.name)
        if not from_toml and toml_path is not None and s.name in toml_values:
            shadowed = _shadowed_toml_value(s, toml_values[s.name], toml_path, value)
            if shadowed is not None:
                shown = "" if s.secret else f" ({shadowed} -> {_show(value)})"
                overridden[s.name] = f"{toml_path} key {s.name} is overridden by {source}{shown}"
                warnings.append(
                    f"{overridden[s.name]}: the file's value is not used "
                    "(precedence: flag > environment > config file)"
                )

    limits = ServerLimits(**{name: values.pop(name) for name in LIMIT_NAMES})
    store = StoreOptions(
        **{name: values.pop(name) for name in STORE_NAMES},
        max_block_bytes=limits.max_block_bytes,
        first_write_wins=first_write_wins_of(values["first_write_wins_tenants"]),
    )
    fields = {RENAMED.get(k, k): v for k, v in values.items()}
    config = ServerConfig(
        **fields,
        limits=limits,
        store=store,
        config_file=toml_path,
        warnings=tuple(warnings),
        sources=tuple(origins),
    )
    try:
        validate(config, file_checks=file_checks)
    except ConfigurationError as exc:
        # "invalid token_file: file not found" names the setting; where a flag or the
        # environment overrode the config file's value, say so: that is the likely cause.
        named = re.match(r"invalid (\w+)", str(exc))
        note = overridden.get(named.group(1)) if named else None
        if note is None:
            raise
        raise ConfigurationError(f"{exc} ({note})") from None
    warnings.extend(resource_warnings(config, explicit, machine=file_checks))
    return dataclasses.replace(config, warnings=tuple(warnings))


def setting_value(config: ServerConfig, name: str) -> Any:
    """The effective value of setting `name` in `config` (limits included)."""
    if name in LIMIT_NAMES:
        return getattr(config.limits, name)
    if name in STORE_NAMES:
        return getattr(config.store, name)
    return getattr(config, RENAMED.get(name, name))


def format_setting_value(s: Setting, value: Any) -> str:
    """A value as an operator would write it back (sizes in binary units, booleans as
    true/false, lists comma-separated); secrets as `(hidden)` or empty when unset."""
    if s.secret:
        return "(hidden)" if value not in (None, ()) else ""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Address):
        return str(value)
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    if isinstance(value, int) and s.metavar == "SIZE":
        return format_size(value)
    if isinstance(value, str) and s.name == "log_level":
        return value.lower()
    return str(value)


def effective_settings(config: ServerConfig) -> list[tuple[str, str, str]]:
    """(name, value, source) for every setting, in the order of `SETTINGS`: what
    `epistemic-kvcache config show` and RESP `CONFIG GET` print. Secrets never appear."""
    sources = dict(config.sources)
    return [
        (
            s.name,
            format_setting_value(s, setting_value(config, s.name)),
            sources.get(s.name, "default"),
        )
        for s in SETTINGS
    ]


def _show(value: object) -> str:
    if isinstance(value, Address | Path):
        return f"'{value}'"
    return repr(value)


def _shadowed_toml_value(s: Setting, raw: object, toml_path: Path, used: object) -> str | None:
    """How the TOML file's value of `s` reads when a flag or the environment gave it
    another one (None: the same value, nothing is lost)."""
    try:
        value = s.parse(raw)
    except InvalidValue:
        return repr(raw)  # invalid in the file, unused: still a value nobody gets
    if s.path_like and isinstance(value, Path) and not value.is_absolute():
        value = toml_path.parent / value
    return None if value == used else _show(value)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigurationError(f"invalid config: file not found (got '{path}')") from None
    except OSError as exc:
        raise ConfigurationError(f"invalid config: cannot read '{path}': {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"invalid config: '{path}' is not valid TOML: {exc}") from None
    unknown = [key for key in data if key not in SETTINGS_BY_NAME]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, list(SETTINGS_BY_NAME), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigurationError(f"invalid config: unknown keys in '{path}': {', '.join(hints)}")
    return data

"""Server configuration: one frozen `ServerConfig`, loaded in one place.

How it works: every setting is one row of `SETTINGS` (name, parser, default, help). The
row gives the three spellings of the setting — flag `--some-name`, environment
`EPISTEMIC_GRAPH_KVCACHE_SOME_NAME`, TOML key `some_name` — and `load_config` resolves
each row with the precedence flag > environment > TOML file > default, parsing every
raw value with the row's parser so that a bad value fails the same way wherever it
came from: a `ConfigurationError` naming the setting, the value and where it was set.
The `ServerLimits` fields (`shared`) become settings automatically, so a new limit is
configurable the moment it is added there; the settings named like `StoreOptions`
fields (`options`) fill the one options object the store is built from.

Modules: `schema` (`ServerConfig`, `Address`, shared names), `parsing` (raw value ->
value), `settings` (the table and the flags), `checks` (cross-setting, machine and bind
checks), `loading` (`load_config`, the effective settings). Each imports only those
before it in this list.
"""

from epistemic_kvcache.config.cgroup import usable_cores
from epistemic_kvcache.config.checks import (
    check_bind,
    check_hmac_secret,
    check_listeners,
    check_persist_dir,
)
from epistemic_kvcache.config.loading import (
    effective_settings,
    format_setting_value,
    load_config,
    setting_value,
)
from epistemic_kvcache.config.parsing import (
    format_size,
    parse_address,
    parse_bool,
    parse_size,
    parse_size_or_zero,
)
from epistemic_kvcache.config.schema import (
    CLIENT_ENV_NAMES,
    CLIENT_ENV_PREFIX,
    CONFIG_FILE_ENV,
    DEFAULT_ADDR,
    DEFAULT_RESP_ADDR,
    DEFAULT_TENANT,
    ENV_PREFIX,
    HMAC_MIN_SECRET_BYTES,
    JWT_ALGORITHMS,
    MAX_AUTO_EVENT_LOOPS,
    MAX_EVENT_LOOPS,
    PERSIST_DIR_ENV_ALIAS,
    Address,
    ServerConfig,
)
from epistemic_kvcache.config.settings import SETTINGS, SETTINGS_BY_NAME, Setting, add_arguments
from epistemic_kvcache.shared import is_loopback_host

__all__ = [
    "CLIENT_ENV_NAMES",
    "CLIENT_ENV_PREFIX",
    "CONFIG_FILE_ENV",
    "DEFAULT_ADDR",
    "DEFAULT_RESP_ADDR",
    "DEFAULT_TENANT",
    "ENV_PREFIX",
    "HMAC_MIN_SECRET_BYTES",
    "JWT_ALGORITHMS",
    "MAX_AUTO_EVENT_LOOPS",
    "MAX_EVENT_LOOPS",
    "PERSIST_DIR_ENV_ALIAS",
    "SETTINGS",
    "SETTINGS_BY_NAME",
    "Address",
    "ServerConfig",
    "Setting",
    "add_arguments",
    "check_bind",
    "check_hmac_secret",
    "check_listeners",
    "check_persist_dir",
    "effective_settings",
    "format_setting_value",
    "format_size",
    "is_loopback_host",
    "load_config",
    "parse_address",
    "parse_bool",
    "parse_size",
    "parse_size_or_zero",
    "setting_value",
    "usable_cores",
]

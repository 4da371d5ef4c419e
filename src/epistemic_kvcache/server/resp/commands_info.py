"""INFO and CONFIG GET: what the server tells a client about itself (docs/resp.md).

How it works: `INFO [section ...]` builds every section as (field, value) pairs and
prints the ones asked for (`default`: all but `commandstats`; `all`/`everything`: all)
in Redis' `# Title` / `field:value` form, RESP3 as a verbatim string. What a section
shows is the caller's: its tenant's keys, stats, connections and commands; the
process-wide figures a monitoring agent alerts on (`used_memory` against `maxmemory`)
are the process's own, and the `loops` section, server-wide traffic, is for operator
tenants only (`metrics_tenants`). `CONFIG GET pattern ...` answers from the Redis
settings clients look at, plus, for operator tenants, every setting of this server and
where it came from.
"""

from __future__ import annotations

import os
import resource
import secrets
import sys
import time
from typing import Final

from epistemic_kvcache.proto import resp_framer
from epistemic_kvcache.proto.resp import Command, ErrorReply, Verbatim
from epistemic_kvcache.server.context import ServerContext
from epistemic_kvcache.server.resp import fast
from epistemic_kvcache.server.resp.common import REDIS_COMPAT_VERSION, to_glob, unknown_subcommand
from epistemic_kvcache.server.resp.refusals import REFUSED_ROUTES
from epistemic_kvcache.server.resp.registry import blocking_command
from epistemic_kvcache.server.resp.session import Session
from epistemic_kvcache.store import core as store_core

REPLID: Final = secrets.token_hex(20)
"""This process's replication id (INFO replication): it has no replicas."""
_INFO_DEFAULT: Final = (
    "server",
    "clients",
    "memory",
    "persistence",
    "stats",
    "replication",
    "cpu",
    "kvcache",
    "keyspace",
    "loops",
)


def loop_info(ctx: ServerContext) -> list[tuple[str, object]]:
    """INFO `loops` (operators): how many event loops serve, then one line per loop:
    `loop0:connections=3,requests=120,busy=0.041,cpu_seconds=1.250`."""
    rows = ctx.loop_view()
    out: list[tuple[str, object]] = [("event_loops", len(rows))]
    for row in rows:
        fields = ",".join(f"{k}={v}" for k, v in row.items() if k != "loop")
        out.append((f"loop{row['loop']}", fields))
    return out


def maxmemory(s: Session) -> int:
    """Bytes the RAM tiers may hold (hot + warm capacity): what `maxmemory` means here."""
    tiers = s.store.stats(None).tiers
    return sum(t.capacity_bytes for name, t in tiers.items() if name in ("hot", "warm"))


def _admin_sections(s: Session) -> list[tuple[str, list[tuple[str, object]]]]:
    """INFO's `replication`, `cpu` and `commandstats` (the caller's tenant's commands)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    stats: list[tuple[str, object]] = []
    if s.identity is not None:
        per_command = dict(s.shared.activity_total(s.identity.tenant).per_command)
        for route in sorted(per_command):
            if route in REFUSED_ROUTES or route == "busy":
                continue
            st = per_command[route]
            usec = int(st.usec)
            per_call = st.usec / st.calls if st.calls else 0.0
            stats.append(
                (
                    f"cmdstat_{route}",
                    f"calls={st.calls},usec={usec},usec_per_call={per_call:.2f},"
                    f"rejected_calls=0,failed_calls={st.failed}",
                )
            )
    return [
        (
            "replication",
            [
                ("role", "master"),
                ("connected_slaves", 0),
                ("master_failover_state", "no-failover"),
                ("master_replid", REPLID),
                ("master_replid2", "0" * 40),
                ("master_repl_offset", 0),
                ("second_repl_offset", -1),
                ("repl_backlog_active", 0),
                ("repl_backlog_size", 0),
                ("repl_backlog_first_byte_offset", 0),
                ("repl_backlog_histlen", 0),
            ],
        ),
        (
            "cpu",
            [
                ("used_cpu_sys", f"{me.ru_stime:.6f}"),
                ("used_cpu_user", f"{me.ru_utime:.6f}"),
                ("used_cpu_sys_children", f"{children.ru_stime:.6f}"),
                ("used_cpu_user_children", f"{children.ru_utime:.6f}"),
            ],
        ),
        ("commandstats", stats),
    ]


@blocking_command(
    "info",
    -1,
    ("loading", "stale"),
    (0, 0, 0),
    "server",
    "Server information and the caller's namespace stats.",
)
def _info(s: Session, cmd: Command) -> object:
    wanted = {bytes(a).decode("ascii", "replace").lower() for a in cmd[1:]}
    if wanted & {"all", "everything"}:
        wanted = {*_INFO_DEFAULT, "commandstats"}
    elif not wanted or "default" in wanted:
        wanted = set(_INFO_DEFAULT)
    ns = s.namespace
    stats = s.call(s.store.stats, ns)
    nkeys = s.call(s.store.count, ns)
    ctx, shared = s.ctx, s.shared
    ready = ctx.readiness()
    activity = shared.activity_total(ns)
    sections: list[tuple[str, list[tuple[str, object]]]] = [
        (
            "server",
            [
                ("redis_version", REDIS_COMPAT_VERSION),
                ("redis_mode", "standalone"),
                ("server_name", "epistemic-kvcache"),
                ("kvcache_version", shared.version),
                ("kvcache_resp_framer", resp_framer.IMPLEMENTATION),
                ("kvcache_store_core", store_core.IMPLEMENTATION),
                ("kvcache_fast_path", fast.IMPLEMENTATION),
                ("arch_bits", 64),
                ("uptime_in_seconds", int(time.monotonic() - shared.started)),
                ("resp_protocols", "2,3"),
                ("ready", int(ready.ready)),
                ("ready_reason", (ready.reason or "ok").replace("\r", " ").replace("\n", " ")),
            ],
        ),
        (
            "clients",
            [
                # this tenant's own connections only: the server-wide count would tell one
                # tenant about the others' traffic
                ("connected_clients", ctx.slots_for("resp").connections_of(ns)),
                ("blocked_clients", 0),
                ("maxclients", ctx.limits.max_connections),
            ],
        ),
        ("memory", _memory_section(s, stats.resident_bytes)),
        (
            "persistence",
            [
                ("loading", 0),
                ("aof_enabled", int(shared.durable)),
                ("rdb_changes_since_last_save", 0),
            ],
        ),
        (
            "stats",
            [
                ("total_connections_received", activity.connections),
                ("total_commands_processed", activity.commands),
                ("keyspace_hits", stats.get_hits),
                ("keyspace_misses", stats.get_misses),
                ("evicted_keys", stats.evictions),
                ("expired_keys", 0),
            ],
        ),
    ]
    kv: list[tuple[str, object]] = []
    for field, value in stats.to_dict().items():
        if field == "tiers":
            for tier, tstats in value.items():
                kv.extend((f"tier_{tier}_{k}", v) for k, v in tstats.items())
        elif field != "extra":
            kv.append((field, value))
    sections += _admin_sections(s)
    sections.append(("kvcache", kv))
    sections.append(("keyspace", [("db0", f"keys={nkeys},expires=0,avg_ttl=0")]))
    if ns in ctx.metrics_tenants:  # server-wide traffic: operators only
        sections.append(("loops", loop_info(ctx)))
    lines: list[str] = []
    for title, fields in sections:
        if title not in wanted:
            continue
        if lines:
            lines.append("")
        lines.append(f"# {'CPU' if title == 'cpu' else title.capitalize()}")
        lines.extend(f"{k}:{v}" for k, v in fields)
    out = "\r\n".join(lines) + ("\r\n" if lines else "")
    return Verbatim(out) if s.protocol_version == 3 else out.encode("utf-8")


def process_rss_bytes() -> int:
    """This process's resident memory now (Linux `/proc/self/statm`; elsewhere the peak
    from `getrusage`): what Redis reports as `used_memory`/`used_memory_rss`."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _peak_rss_bytes()


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS: bytes, Linux: KiB


def _human(n: int) -> str:
    """Redis's `*_human` form: `1.50M`."""
    value = float(n)
    for unit in ("B", "K", "M", "G", "T"):
        if value < 1024 or unit == "T":
            return f"{value:.2f}{unit}" if unit != "B" else f"{n}B"
        value /= 1024
    raise AssertionError("unreachable")


def _memory_section(s: Session, tenant_resident: int) -> list[tuple[str, object]]:
    """`INFO memory`: the process's memory, as Redis reports its own (monitoring alerts on
    `used_memory` against `maxmemory`); the caller's stored bytes in RAM have their own
    field, `tenant_resident_bytes`."""
    rss = process_rss_bytes()
    limit = s.call(maxmemory, s)
    return [
        ("used_memory", rss),
        ("used_memory_human", _human(rss)),
        ("used_memory_rss", rss),
        ("used_memory_rss_human", _human(rss)),
        ("used_memory_peak", max(rss, _peak_rss_bytes())),
        ("used_memory_peak_human", _human(max(rss, _peak_rss_bytes()))),
        ("tenant_resident_bytes", tenant_resident),
        ("maxmemory", limit),
        ("maxmemory_human", _human(limit)),
        ("maxmemory_policy", "allkeys-lru"),
        ("mem_allocator", "libc"),
    ]


def _config_table(s: Session) -> dict[str, str]:
    limits = s.limits
    durable = s.shared.durable
    return {
        "save": "",
        "appendonly": "yes" if durable else "no",
        "appendfsync": "always" if durable else "no",
        "databases": "1",
        "maxclients": str(limits.max_connections),
        "proto-max-bulk-len": str(limits.max_block_bytes),
        "timeout": str(int(limits.idle_timeout_s)),
        "maxmemory": str(maxmemory(s)),
        "maxmemory-policy": "allkeys-lru",
    }


def _settings_table(s: Session) -> dict[str, str]:
    """Every setting of this server as `<name>` -> value and `<name>.source` -> where it
    came from (default, flag --x, env NAME, file PATH); operators only (the tenants of
    `metrics_tenants`, as for `/metrics`): paths and limits are not a tenant's business.
    Secrets show as `(hidden)`."""
    if s.namespace not in s.ctx.metrics_tenants:
        return {}
    out: dict[str, str] = {}
    for name, value, source in s.ctx.settings:
        out[name] = value
        out[f"{name}.source"] = source
    return out


@blocking_command(
    "config",
    -2,
    ("admin", "noscript", "loading", "stale"),
    (0, 0, 0),
    "server",
    "CONFIG GET: the Redis settings clients look at; for operators every setting and its source.",
)
def _config(s: Session, cmd: Command) -> object:
    if bytes(cmd[1]).upper() != b"GET":
        return unknown_subcommand(cmd[1], "CONFIG")
    if len(cmd) < 3:
        return ErrorReply("ERR wrong number of arguments for 'config|get' command")
    globs = [to_glob(bytes(pattern).lower()) for pattern in cmd[2:]]
    table = s.call(_config_table, s) | _settings_table(s)
    out: dict[str, str] = {}
    for glob in globs:
        for name, value in table.items():
            if glob.match(name.encode()):
                out[name] = value
    return out

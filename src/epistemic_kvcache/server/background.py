"""The server's background tasks, each an endless loop the runner (server/app.py) starts.

- `log_stats_forever`: one `format_stats` log line (hit rate, dedup, tiers) per interval.
- `retire_forever`: a bounded `retire_stale` on the thread pool every `retire_interval_s`
  (stale-epoch entries and expired snapshots; reads are right whether or not it ran).
- `watch_epochs_forever`: about once a second, reads the epochs of the scopes this
  server has seen from the shared registry and publishes those another process bumped
  on the RESP channel `kvcache:epochs` (one watcher for all event loops: the notifier
  delivers to each subscriber on its own loop).
- `sample_loop_forever`: on every event loop, how busy its thread was over the last
  `LOOP_SAMPLE_S` (thread CPU time over wall time), for the per-loop view.
Store calls run on the thread pool (`ctx.run`); a failing tick is logged, never fatal.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time

from epistemic_kvcache.config import format_size
from epistemic_kvcache.errors import KvCacheError
from epistemic_kvcache.server.context import ServerContext
from epistemic_kvcache.store.api import SharedKvBackend, StoreStats

log = logging.getLogger("epistemic_kvcache.server")


def human_size(n: int) -> str:
    """Bytes with one decimal in the largest binary unit that keeps the number >= 1."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{n}B" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"


def format_stats(stats: StoreStats) -> str:
    """One log line: hit rate, dedup rate and tier occupancy (whole store)."""
    gets = stats.get_hits + stats.get_misses
    hit_rate = stats.get_hits / gets if gets else 0.0
    dedup_rate = stats.dedup_savings_bytes / stats.logical_bytes if stats.logical_bytes else 0.0
    parts = [
        f"hit_rate={hit_rate:.3f}",
        f"gets={gets}",
        f"puts={stats.put_new}",
        f"dedup_rate={dedup_rate:.3f}",
        f"dedup_hits={stats.dedup_hits}",
        f"blocks={stats.unique_blocks}",
        f"keys={stats.total_refs}",
    ]
    for name, tier in stats.tiers.items():
        used = tier.bytes / tier.capacity_bytes if tier.capacity_bytes else 0.0
        parts.append(
            f"{name}={human_size(tier.bytes)}/{format_size(tier.capacity_bytes)}"
            f"({used:.0%},{tier.blocks}blk)"
        )
    if stats.integrity_failures:
        parts.append(f"integrity_failures={stats.integrity_failures}")
    return "stats " + " ".join(parts)


async def log_stats_forever(ctx: ServerContext, interval_s: float) -> None:
    """Every `interval_s`, log `format_stats` of the whole store."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            stats = await ctx.run(ctx.store.stats, None)
        except Exception:
            log.exception("stats collection failed")
            continue
        log.info("%s", format_stats(stats))


RETIRE_MAX_ITEMS = 1000
"""Stale entries one `retire_stale` tick may remove (bounded work per tick)."""
RETIRE_BUDGET_S = 0.05
"""Time one `retire_stale` tick may spend scanning."""
EPOCH_POLL_S = 1.0
"""How often the registry is polled for epoch bumps made by other processes."""


async def retire_forever(ctx: ServerContext, interval_s: float) -> None:
    """Every `interval_s`, reclaim stale entries and expired snapshots, bounded per tick."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            removed = await ctx.run(
                functools.partial(
                    ctx.store.retire_stale, max_items=RETIRE_MAX_ITEMS, budget_s=RETIRE_BUDGET_S
                )
            )
        except Exception:
            log.exception("retire_stale failed")
            continue
        if removed:
            log.debug("retire_stale removed %d entries", removed)


async def watch_epochs_forever(ctx: ServerContext, interval_s: float = EPOCH_POLL_S) -> None:
    """Publish epoch bumps made by other processes sharing the registry.

    Polls the scopes this server has seen (`ServerContext.epochs.known`), one thread-pool
    job per tick, and publishes every epoch that moved since the last tick.
    """
    while True:
        await asyncio.sleep(interval_s)
        watched = ctx.epochs.watched()
        if not watched:
            continue
        try:
            current = await ctx.run(_read_epochs, ctx.store, watched)
        except Exception:
            log.exception("epoch poll failed")
            continue
        for (tenant, scope), epoch in zip(watched, current, strict=True):
            if epoch is None:
                continue
            if ctx.epochs.baseline(tenant, scope):
                ctx.epochs.watch(tenant, scope, epoch)  # first read: a baseline, not news
            else:
                ctx.epochs.publish(tenant, scope, epoch)


def _read_epochs(store: SharedKvBackend, pairs: list[tuple[str, str]]) -> list[int | None]:
    out: list[int | None] = []
    for tenant, scope in pairs:
        try:
            out.append(store.epoch_get(tenant, scope))
        except KvCacheError:
            out.append(None)
    return out


LOOP_SAMPLE_S = 1.0
"""How often each event loop samples its thread's CPU time (`LoopStats.busy`)."""


async def sample_loop_forever(ctx: ServerContext, interval_s: float = LOOP_SAMPLE_S) -> None:
    """Keep `ctx.loop` (this event loop's stats) current: its thread, and the fraction of
    each `interval_s` that thread spent on a CPU (1.0: the loop never waited)."""
    stats = ctx.loop
    stats.thread_id = threading.get_ident()
    wall, cpu = time.monotonic(), time.thread_time()
    while True:
        await asyncio.sleep(interval_s)
        now_wall, now_cpu = time.monotonic(), time.thread_time()
        stats.cpu_s = now_cpu
        if now_wall > wall:
            stats.busy = min(1.0, (now_cpu - cpu) / (now_wall - wall))
        wall, cpu = now_wall, now_cpu

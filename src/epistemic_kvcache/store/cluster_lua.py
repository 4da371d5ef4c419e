"""Cluster mode's data layout: key names, the key-entry format, and the Lua scripts.

Layout (see docs/cluster.md for the reasoning)
-----------------------------------------------
Everything of one tenant except block bytes lives in ONE hash slot, named by the hash
tag `{<prefix>:t:<tenant hex>}`, so one script updates it atomically:

| key | type | holds |
|---|---|---|
| `{P:t:T}:k` | hash | key -> entry (digest, generation, op id, size, pins, epoch tag) |
| `{P:t:T}:z` | sorted set | the keys, score 0: sorted listing (SCAN) and the key count |
| `{P:t:T}:e` | hash | epoch scope -> epoch |
| `{P:t:T}:c` | hash | counters (`keys`, `logical_bytes` exact; the rest from front-ends) |

A block lives in the slot of its digest, `P:b:{<digest hex>}` (global dedup scope) or
`P:b:{<digest hex>}:<tenant hex>` (namespace scope): one hash with the bytes `d`, the
reference count `r`, the pinned-reference count `p`, the generation `g` (random, new each
time the block is created) and `t` (server time in ms of the last reference change).
The count lives with the bytes, so when the cluster evicts a block its count goes too.

An entry is `digest (32 bytes) | generation (8) | op id (8) | "size,pins,epoch,scope"`
(`epoch` empty: untagged). Reference rules that keep every entry's block alive:
1. a reference is taken on the block (`BLOB_REF`) before an entry names it;
2. a reference is dropped (`BLOB_ADJ`) only after the entry stopped naming it, and only
   once, and only on the same generation (a block evicted and stored again is a new
   generation: references to the old one died with it);
3. a write whose outcome is unknown is never assumed undone: at worst a reference
   leaks, and the scrub (`SCRUB_FIX`) takes leaked references back.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

DIGEST_LEN = 32
GEN_LEN = 8
OP_LEN = 8
_HEAD = DIGEST_LEN + GEN_LEN + OP_LEN
_U64 = struct.Struct(">Q")


def tenant_tag(prefix: str, tenant: str) -> bytes:
    """The hash tag of a tenant's slot."""
    return f"{{{prefix}:t:{tenant.encode().hex()}}}".encode()


@dataclass(frozen=True, slots=True)
class TenantKeys:
    """The Redis keys of one tenant (all in one slot)."""

    entries: bytes
    order: bytes
    epochs: bytes
    counters: bytes

    @classmethod
    def of(cls, prefix: str, tenant: str) -> TenantKeys:
        t = tenant_tag(prefix, tenant)
        return cls(t + b":k", t + b":z", t + b":e", t + b":c")


def blob_key(prefix: str, digest: bytes, tenant: str | None) -> bytes:
    """The Redis key of a block (tenant None: global dedup scope)."""
    k = f"{prefix}:b:{{{digest.hex()}}}".encode()
    return k if tenant is None else k + b":" + tenant.encode().hex().encode()


def tenants_key(prefix: str) -> bytes:
    """A set of every tenant (hex) that ever wrote (for fleet-wide stats and the scrub)."""
    return f"{{{prefix}}}:tenants".encode()


def lock_key(prefix: str) -> bytes:
    """The scrub's lease (one front-end scrubs at a time)."""
    return f"{{{prefix}}}:scrub-lock".encode()


def epoch_channel(prefix: str) -> bytes:
    """Pub/sub channel of epoch bumps: `<tenant hex> <epoch> <scope>`."""
    return f"{prefix}:epochs".encode()


@dataclass(frozen=True, slots=True)
class Entry:
    """A decoded key entry."""

    digest: bytes
    gen: bytes
    op: bytes
    size: int
    pins: int
    epoch: int | None
    scope: str
    raw: bytes

    @property
    def ref(self) -> bytes:
        """What a reference names: digest + generation."""
        return self.raw[: DIGEST_LEN + GEN_LEN]


def parse_entry(raw: bytes) -> Entry:
    """Decode an entry; ValueError when it is not one (written by something else)."""
    if len(raw) < _HEAD + 4:
        raise ValueError("entry too short")
    tail = raw[_HEAD:].decode("utf-8")
    size, pins, epoch, scope = tail.split(",", 3)
    return Entry(
        raw[:DIGEST_LEN],
        raw[DIGEST_LEN : DIGEST_LEN + GEN_LEN],
        raw[DIGEST_LEN + GEN_LEN : _HEAD],
        int(size),
        int(pins),
        int(epoch) if epoch else None,
        scope,
        raw,
    )


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script and its SHA-1 (for EVALSHA)."""

    name: str
    source: bytes

    @property
    def sha(self) -> str:
        return hashlib.sha1(self.source, usedforsecurity=False).hexdigest()


NOW_LUA = b"""
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""

PARSE_LUA = b"""
local function fields(v)
  local size, pins, ep, sc = string.match(string.sub(v, 49), '^(%d+),(%d+),(%d*),(.*)$')
  return tonumber(size), tonumber(pins), ep, sc
end
local function is_stale(v, epochs)
  local _, _, ep, sc = fields(v)
  if ep == '' then return false end
  return tonumber(ep) < tonumber(redis.call('HGET', epochs, sc) or '0')
end
"""

ENTRY_PUT = Script(
    "entry_put",
    NOW_LUA
    + PARSE_LUA
    + b"""
-- KEYS: entries, order, epochs, counters
-- ARGV: key, digest..gen, op, size, scope ('' none), cond ('' | nx | xx), fww ('0'|'1'),
--       t_ref (ms, when the block reference was taken), max_inflight_ms, key_quota
-- -> {outcome, the entry before (or false), server time ms}
local now = now_ms()
local cur = redis.call('HGET', KEYS[1], ARGV[1])
local live = false
local old_size, pins = 0, 0
if cur then
  if string.sub(cur, 41, 48) == ARGV[3] then return {'again', cur, now} end
  old_size, pins = fields(cur)
  if not is_stale(cur, KEYS[3]) then live = cur end
end
local newd = string.sub(ARGV[2], 1, 32)
local outcome
if not live then
  if ARGV[6] == 'xx' then outcome = 'missing' else outcome = 'new' end
elseif ARGV[6] == 'nx' then outcome = 'conflict'
elseif string.sub(live, 1, 32) == newd then outcome = 'duplicate'
elseif ARGV[7] == '1' and ARGV[6] == '' then outcome = 'conflict'
else outcome = 'replaced' end
if outcome == 'missing' or outcome == 'conflict' then return {outcome, cur or false, now} end
if outcome == 'duplicate' and string.sub(live, 33, 40) == string.sub(ARGV[2], 33, 40) then
  return {outcome, cur, now}
end
if now - tonumber(ARGV[8]) > tonumber(ARGV[9]) then return {'expired', false, now} end
local quota = tonumber(ARGV[10])
if not cur and quota > 0 and redis.call('ZCARD', KEYS[2]) >= quota then
  return {'quota', false, now}
end
local ep = ''
if ARGV[5] ~= '' then ep = redis.call('HGET', KEYS[3], ARGV[5]) or '0' end
redis.call('HSET', KEYS[1], ARGV[1],
  ARGV[2] .. ARGV[3] .. ARGV[4] .. ',' .. pins .. ',' .. ep .. ',' .. ARGV[5])
if not cur then
  redis.call('ZADD', KEYS[2], 0, ARGV[1])
  redis.call('HINCRBY', KEYS[4], 'keys', 1)
end
redis.call('HINCRBY', KEYS[4], 'logical_bytes', tonumber(ARGV[4]) - old_size)
if pins > 0 then redis.call('HINCRBY', KEYS[4], 'pinned_bytes', tonumber(ARGV[4]) - old_size) end
return {outcome, cur or false, now}
""",
)

ENTRY_GET = Script(
    "entry_get",
    PARSE_LUA
    + b"""
-- KEYS: entries, epochs; ARGV: keys. Per key: false (absent), {'live'|'stale', entry}
local out = {}
for i, key in ipairs(ARGV) do
  local cur = redis.call('HGET', KEYS[1], key)
  if not cur then
    out[i] = false
  elseif is_stale(cur, KEYS[2]) then
    out[i] = {'stale', cur}
  else
    out[i] = {'live', cur}
  end
end
return out
""",
)

ENTRY_DEL = Script(
    "entry_del",
    NOW_LUA
    + PARSE_LUA
    + b"""
-- KEYS: entries, order, counters; ARGV: key, expected entry ('' any)
-- -> {the removed entry, server time ms}, or false
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return false end
if ARGV[2] ~= '' and cur ~= ARGV[2] then return false end
local size, pins = fields(cur)
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[3], 'keys', -1)
redis.call('HINCRBY', KEYS[3], 'logical_bytes', -size)
if pins > 0 then
  redis.call('HINCRBY', KEYS[3], 'pinned_bytes', -size)
  redis.call('HINCRBY', KEYS[3], 'pinned_keys', -1)
end
return {cur, now_ms()}
""",
)

ENTRY_PIN = Script(
    "entry_pin",
    PARSE_LUA
    + b"""
-- KEYS: entries, epochs, counters; ARGV: key, delta (+1 / -1), pinned-bytes limit (0: none)
-- The entry after the change; false when absent (or stale), 'nopin' when unpinning an
-- unpinned key, 'quota' when the tenant's pinned bytes would pass the limit.
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur or is_stale(cur, KEYS[2]) then return false end
local size, pins, ep, sc = fields(cur)
local now = pins + tonumber(ARGV[2])
if now < 0 then return 'nopin' end
if pins == 0 and now > 0 then
  local limit = tonumber(ARGV[3])
  local used = tonumber(redis.call('HGET', KEYS[3], 'pinned_bytes') or '0')
  if limit > 0 and used + size > limit then return 'quota' end
  redis.call('HINCRBY', KEYS[3], 'pinned_bytes', size)
  redis.call('HINCRBY', KEYS[3], 'pinned_keys', 1)
elseif pins > 0 and now == 0 then
  redis.call('HINCRBY', KEYS[3], 'pinned_bytes', -size)
  redis.call('HINCRBY', KEYS[3], 'pinned_keys', -1)
end
local v = string.sub(cur, 1, 48) .. size .. ',' .. now .. ',' .. ep .. ',' .. sc
redis.call('HSET', KEYS[1], ARGV[1], v)
return v
""",
)

ENTRY_POP = Script(
    "entry_pop",
    NOW_LUA
    + PARSE_LUA
    + b"""
-- KEYS: entries, order, counters; ARGV: n. Removes up to n keys (in order)
-- -> {server time ms, {their entries}}
local keys = redis.call('ZRANGE', KEYS[2], 0, tonumber(ARGV[1]) - 1)
local out = {}
local bytes, pinned, pinned_keys = 0, 0, 0
for i, key in ipairs(keys) do
  local cur = redis.call('HGET', KEYS[1], key)
  redis.call('ZREM', KEYS[2], key)
  if cur then
    redis.call('HDEL', KEYS[1], key)
    local size, pins = fields(cur)
    bytes = bytes + size
    if pins > 0 then
      pinned = pinned + size
      pinned_keys = pinned_keys + 1
    end
    out[#out + 1] = cur
  end
end
if #out > 0 then
  redis.call('HINCRBY', KEYS[3], 'keys', -#out)
  redis.call('HINCRBY', KEYS[3], 'logical_bytes', -bytes)
  if pinned_keys > 0 then
    redis.call('HINCRBY', KEYS[3], 'pinned_bytes', -pinned)
    redis.call('HINCRBY', KEYS[3], 'pinned_keys', -pinned_keys)
  end
end
return {now_ms(), out}
""",
)

EPOCH_BUMP = Script(
    "epoch_bump",
    b"""
-- KEYS: epochs; ARGV: scope, max scopes, channel, tenant hex. New epoch, -1: quota.
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0
   and redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[2]) then
  return -1
end
local n = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('PUBLISH', ARGV[3], ARGV[4] .. ' ' .. n .. ' ' .. ARGV[1])
return n
""",
)

BLOB_REF = Script(
    "blob_ref",
    NOW_LUA
    + b"""
-- KEYS: block; ARGV: new generation, ttl ms
-- -> {generation, now ms, created (0|1)}, or false when the block is absent.
-- A new block's bytes are written by an HSETNX just before, in the same MULTI (so the
-- bytes never pass through Lua): bytes without a generation are a block to initialise.
local now = now_ms()
local g = redis.call('HGET', KEYS[1], 'g')
if g then
  redis.call('HINCRBY', KEYS[1], 'r', 1)
  redis.call('HSET', KEYS[1], 't', now)
  if tonumber(ARGV[2]) > 0 and tonumber(redis.call('HGET', KEYS[1], 'p') or '0') == 0 then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
  end
  return {g, now, 0}
end
if redis.call('HEXISTS', KEYS[1], 'd') == 0 then return false end
redis.call('HSET', KEYS[1], 'r', 1, 'p', 0, 'g', ARGV[1], 't', now)
redis.call('HDEL', KEYS[1], 'z')
if tonumber(ARGV[2]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return {ARGV[1], now, 1}
""",
)

BLOB_ADJ = Script(
    "blob_adj",
    NOW_LUA
    + b"""
-- KEYS: block; ARGV: generation, refs delta, pins delta, ttl ms, removed ms, limit ms
-- -> {refs left, bytes freed}; {-1, 0} when the generation is gone; {-2, 0} when a release
-- comes more than `limit` after its entry was removed (`removed`, the tenant master's
-- clock; 0: unchecked): refused, so a scrub that waited that long cannot be undercut
local g = redis.call('HGET', KEYS[1], 'g')
if g ~= ARGV[1] then return {-1, 0} end
local removed = tonumber(ARGV[5] or '0')
if removed > 0 and now_ms() - removed > tonumber(ARGV[6]) then return {-2, 0} end
local r = tonumber(redis.call('HGET', KEYS[1], 'r') or '0') + tonumber(ARGV[2])
if r <= 0 then
  local n = redis.call('HSTRLEN', KEYS[1], 'd')
  redis.call('DEL', KEYS[1])
  return {0, n}
end
local p = tonumber(redis.call('HGET', KEYS[1], 'p') or '0') + tonumber(ARGV[3])
if p < 0 then p = 0 end
redis.call('HSET', KEYS[1], 'r', r, 'p', p, 't', now_ms())
if p > 0 then
  redis.call('PERSIST', KEYS[1])
elseif tonumber(ARGV[4]) > 0 and tonumber(ARGV[3]) ~= 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
end
return {r, 0}
""",
)

BLOB_DROP = Script(
    "blob_drop",
    b"""
-- KEYS: block; ARGV: generation. Deletes a damaged block -> bytes freed (0: not that one)
if redis.call('HGET', KEYS[1], 'g') ~= ARGV[1] then return 0 end
local n = redis.call('HSTRLEN', KEYS[1], 'd')
redis.call('DEL', KEYS[1])
return n
""",
)

SCRUB_FIX = Script(
    "scrub_fix",
    b"""
-- KEYS: block; ARGV: generation, refs seen, t seen, refs counted, pins counted, ttl ms
-- Sets the counts to what the entries say iff nothing touched the block since it was
-- read (same generation, refs and t). -> bytes freed (0) or -1 when it changed.
local g, r, t = unpack(redis.call('HMGET', KEYS[1], 'g', 'r', 't'))
if g ~= ARGV[1] or r ~= ARGV[2] or t ~= ARGV[3] then return -1 end
if tonumber(ARGV[4]) <= 0 then
  local n = redis.call('HSTRLEN', KEYS[1], 'd')
  redis.call('DEL', KEYS[1])
  return n
end
redis.call('HSET', KEYS[1], 'r', ARGV[4], 'p', ARGV[5])
if tonumber(ARGV[5]) > 0 then
  redis.call('PERSIST', KEYS[1])
elseif tonumber(ARGV[6]) > 0 and redis.call('PTTL', KEYS[1]) < 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
end
return 0
""",
)

SCRUB_BARE = Script(
    "scrub_bare",
    b"""
-- KEYS: block; ARGV: now ms, grace ms. Bytes without a generation (a writer died between
-- its HSETNX and the script of the same MULTI, or a NOSCRIPT in between): marked the
-- first time the scrub sees them, deleted by a later scrub. -> bytes freed
if redis.call('HEXISTS', KEYS[1], 'g') == 1 then return 0 end
local z = redis.call('HGET', KEYS[1], 'z')
if not z then
  redis.call('HSET', KEYS[1], 'z', ARGV[1])
  return 0
end
if tonumber(ARGV[1]) - tonumber(z) < tonumber(ARGV[2]) then return 0 end
local n = redis.call('HSTRLEN', KEYS[1], 'd')
redis.call('DEL', KEYS[1])
return n
""",
)

SCRIPTS = (
    ENTRY_PUT,
    ENTRY_GET,
    ENTRY_DEL,
    ENTRY_PIN,
    ENTRY_POP,
    EPOCH_BUMP,
    BLOB_REF,
    BLOB_ADJ,
    BLOB_DROP,
    SCRUB_FIX,
    SCRUB_BARE,
)


def pack_u64(n: int) -> bytes:
    return _U64.pack(n)

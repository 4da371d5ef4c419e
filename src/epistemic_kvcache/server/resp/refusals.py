"""The commands this server does not serve, each with why, and how a refusal is answered.

- A Redis command we refuse on purpose (`UNSUPPORTED`: name -> reason) is answered
  `-ERR unsupported command '<name as sent>': <reason>`, and counted under the one
  metrics route `unsupported` (the access log names the command). It is not in the
  command table, so `COMMAND` does not list it. Before AUTH it gets `-NOAUTH`, as every
  command Redis knows does from redis-server with `requirepass`.
- Any other name (a typo) is answered as redis-server does,
  `-ERR unknown command '<name>', with args beginning with: '<arg>' ...`, counted under
  the route `unknown`; before AUTH too (redis-server looks the command up first).
- `ProbeAnswer`: an error reply that is the expected answer to a client library's
  capability probe (redis-py 8's `CLIENT MAINT_NOTIFICATIONS ON ...` on connect): the
  text is what Redis 7.0 answers, and it is counted as `ok`, not as an error.

tests/test_server_resp_refusals.py holds the table to redis-server's own `COMMAND LIST`:
every Redis 7.0 command is served or refused here with a reason.
"""

from __future__ import annotations

from typing import Final

from epistemic_kvcache.proto.resp import Buffer, Command, ErrorReply
from epistemic_kvcache.server.oplog import escape_text
from epistemic_kvcache.server.resp.common import text

ROUTE_UNSUPPORTED: Final = "unsupported"
"""The metrics route of every command refused on purpose (one label value for all)."""
ROUTE_UNKNOWN: Final = "unknown"
"""The metrics route of every command no Redis has (typos): one label value for all."""
REFUSED_ROUTES: Final = frozenset({ROUTE_UNSUPPORTED, ROUTE_UNKNOWN})
NAME_IN_LOG: Final = 64
"""Bytes of a refused command's name the access log keeps (then escaped)."""


class ProbeAnswer(ErrorReply):
    """An error reply that answers a client library's capability probe as Redis 7.0
    does; counted as `ok` (it is the answer the library expects from such a server)."""

    __slots__ = ()


_KINDS: Final = {
    "hashes": "hset hsetnx hget hmset hmget hgetall hdel hlen hkeys hvals hexists hincrby "
    "hincrbyfloat hscan hstrlen hrandfield",
    "lists": "lpush rpush lpushx rpushx lpop rpop lrange llen lindex lset lrem ltrim linsert "
    "lpos lmove blmove rpoplpush brpoplpush blpop brpop lmpop blmpop",
    "sets": "sadd srem smembers sismember smismember scard spop srandmember sinter sinterstore "
    "sintercard sunion sunionstore sdiff sdiffstore smove sscan",
    "sorted sets": "zadd zrem zrange zrangestore zrangebyscore zrevrangebyscore zrangebylex "
    "zrevrangebylex zrevrange zscore zmscore zcard zcount zlexcount zincrby zrank zrevrank "
    "zpopmin zpopmax bzpopmin bzpopmax zmpop bzmpop zscan zunion zunionstore zinter "
    "zinterstore zintercard zdiff zdiffstore zrandmember zremrangebyscore zremrangebyrank "
    "zremrangebylex",
    "streams": "xadd xread xreadgroup xrange xrevrange xlen xdel xtrim xgroup xack xpending "
    "xclaim xautoclaim xinfo xsetid",
    "HyperLogLogs": "pfadd pfcount pfmerge pfdebug pfselftest",
    "geo indexes": "geoadd geodist geohash geopos georadius georadiusbymember geosearch "
    "geosearchstore georadius_ro georadiusbymember_ro",
    "bitmaps": "setbit getbit bitcount bitpos bitop bitfield bitfield_ro",
    "lists, sets or sorted sets to sort": "sort sort_ro",
}
"""Commands of the data types this server does not have, by the type's name."""

_REASONS: Final = {
    "blocks are immutable values (content-addressed, deduplicated); use SET to replace a "
    "value whole": "incr decr incrby decrby incrbyfloat append setrange",
    "blocks are read whole (each read is verified against its digest); use GET": (
        "getrange substr lcs"
    ),
    "entries never expire here; the cache tiers evict them and DEL removes them": (
        "expire pexpire expireat pexpireat setex psetex"
    ),
    "keys are not created together atomically here; use SET key value NX for each": "msetnx",
    "keys are not renamed; SET the new key to the value (its bytes are stored once) and "
    "DEL the old one": "rename renamenx",
    "SET the new key to the value: its bytes are stored once (deduplicated)": "copy",
    "there is one database per tenant (SELECT 0)": "move swapdb",
    "values are raw bytes without Redis' serialization; use GET and SET": (
        "dump restore restore-asking migrate"
    ),
    "keys are listed in order; use SCAN": "randomkey",
    "access times are not tracked per key": "touch",
    "it would delete every tenant's keys; FLUSHDB deletes this tenant's keys": "flushall",
    "there are no replicas: a durable store acknowledges a write once it is on disk": (
        "wait waitaof"
    ),
    "this server is standalone, without replication (INFO replication: role:master)": (
        "replicaof slaveof sync psync replconf failover role"
    ),
    "this server is standalone, not a Redis Cluster node": "cluster readonly readwrite asking",
    "there is no server-side scripting": (
        "eval evalsha eval_ro evalsha_ro script function fcall fcall_ro"
    ),
    "there is no RDB or AOF file: persistence is the store's own (docs/store.md)": (
        "save bgsave bgrewriteaof lastsave"
    ),
    "stop the server with SIGTERM (it drains its connections first)": "shutdown",
    "there are no debugging commands on the wire": "debug",
    "it would show every tenant's commands; operators read the access log (--access-log)": (
        "monitor"
    ),
    "no slow log is kept; request latencies are in /metrics "
    "(kvcache_request_duration_seconds)": "slowlog latency",
    "identities come from tokens, JWTs or client certificates (docs/security.md), not ACL "
    "users": "acl",
    "there are no modules": "module",
    "the only channel is kvcache:epochs, which the server publishes to; SUBSCRIBE to it": (
        "publish spublish psubscribe punsubscribe ssubscribe sunsubscribe pubsub"
    ),
    "this server has no LOLWUT art": "lolwut",
}
"""Reason -> the commands refused for it."""

UNSUPPORTED: Final[dict[bytes, str]] = {}
"""Command name (lower case) -> why it is refused."""
for _kind, _names in _KINDS.items():
    for _name in _names.split():
        UNSUPPORTED[_name.encode()] = (
            f"this server stores strings only (GET/SET values, KV-cache blocks); there are "
            f"no {_kind}"
        )
for _why, _names in _REASONS.items():
    for _name in _names.split():
        UNSUPPORTED[_name.encode()] = _why


def unsupported_command(cmd: Command, why: str) -> ErrorReply:
    """`-ERR unsupported command '<name>': <why>` (the name as the client sent it)."""
    return ErrorReply(f"ERR unsupported command '{text(cmd[0])}': {why}")


def unknown_command(cmd: Command) -> ErrorReply:
    """redis-server's answer to a command it does not know."""
    args = ""
    for arg in cmd[1:]:
        if len(args) >= 128:
            break
        args += f"'{text(arg, 128 - len(args))}' "
    return ErrorReply(f"ERR unknown command '{text(cmd[0])}', with args beginning with: {args}")


def refusal(cmd: Command, authenticated: bool) -> tuple[str, ErrorReply | None]:
    """A command not in the table: its route and the error, or (route, None) when it is
    refused on purpose but the session is not authenticated (the caller answers NOAUTH)."""
    why = UNSUPPORTED.get(bytes(cmd[0]).lower())
    if why is None:
        return ROUTE_UNKNOWN, unknown_command(cmd)
    if not authenticated:
        return ROUTE_UNSUPPORTED, None
    return ROUTE_UNSUPPORTED, unsupported_command(cmd, why)


def logged_name(route: str, name: Buffer) -> str:
    """The access log's request for a refused command: `unknown:<name>`, the name's
    first `NAME_IN_LOG` bytes, escaped."""
    return f"{route}:{escape_text(text(name, NAME_IN_LOG))}"

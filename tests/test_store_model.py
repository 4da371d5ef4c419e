"""Both store backends against a dict model (Hypothesis state machine).

The model is `(ns, key) -> bytes` plus pin counts and the PUT counters. Keys and contents
come from small pools, so repeat PUTs (duplicates), replacements, create-only (`nx`) and
replace-only (`xx`) refusals and cross-key dedup happen all the time. Capacities are
large, so nothing moves between tiers on its own; only the `evict` rule pushes blocks out
of RAM. After every step the store's own deep consistency check must pass and every stat
must match a recount from the model.
The durable machine also closes and reopens the store (counters are per process: they
restart at zero, the data and pins do not).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from typing import ClassVar

import blake3
import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from epistemic_kvcache.options import StoreOptions
from epistemic_kvcache.store import (
    PutOutcome,
    SharedKvBackend,
    SharedKvIndex,
    SharedKvStoreBackend,
)

NAMESPACES = ["t1", "t2", "tenant/é"]
KEYS = ["a", "b", "c", "model@0001@ff@chunk", "ключ"]
CONTENTS = [
    b"",
    b"x",
    b"hello world",
    bytes(range(256)) * 16,  # 4 KiB, compressible
    b"\x00\x01" * 1000,
    bytes(blake3.blake3(b"seed").digest(length=20_000)),  # incompressible
]

Ref = tuple[str, str]


class StoreModel(RuleBasedStateMachine):
    """Rules and invariants shared by both backends; subclasses say how to open a store."""

    durable: ClassVar[bool] = False
    pressure: ClassVar[bool] = False  # tiny RAM tiers: tier movement is not modelled

    def __init__(self) -> None:
        super().__init__()
        self.store: SharedKvBackend | None = None
        self.scope = "namespace"
        self.tmpdir: str | None = None
        self.data: dict[Ref, bytes] = {}
        self.pins: dict[Ref, int] = {}
        self.hot: set[tuple[str, bytes]] = set()  # blobs with a copy in the hot tier
        self.counters: dict[str, Counter[str]] = {ns: Counter() for ns in NAMESPACES}

    # -- helpers -------------------------------------------------------------------------
    def open_store(self, *, rebuild: bool = False) -> SharedKvBackend:
        raise NotImplementedError

    @property
    def s(self) -> SharedKvBackend:
        assert self.store is not None
        return self.store

    def scope_of(self, ref: Ref) -> tuple[str, bytes]:
        """The dedup identity of a key's content: (namespace or '', bytes)."""
        ns = ref[0] if self.scope == "namespace" else ""
        return ns, self.data[ref]

    def same_blob(self, ref: Ref) -> list[Ref]:
        ident = self.scope_of(ref)
        return [r for r in self.data if self.scope_of(r) == ident]

    def count(self, ns: str, name: str, n: int = 1) -> None:
        self.counters[ns][name] += n

    def owners(self, ref: Ref) -> set[str]:
        return {r[0] for r in self.same_blob(ref)}

    def touch(self, ref: Ref) -> None:
        """A read hit: a block that is not in hot is promoted (counted by every owner)."""
        ident = self.scope_of(ref)
        if ident not in self.hot:
            self.hot.add(ident)
            for owner in self.owners(ref):
                self.count(owner, "promotions")

    # -- lifecycle -----------------------------------------------------------------------
    @initialize(scope=st.sampled_from(["namespace", "global"]))
    def start(self, scope: str) -> None:
        self.scope = scope
        if self.durable:
            self.tmpdir = tempfile.mkdtemp(prefix="kvmodel-")
        self.store = self.open_store()

    def teardown(self) -> None:
        if self.store is not None:
            self.store.close()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    # -- rules ---------------------------------------------------------------------------
    @rule(
        ns=st.sampled_from(NAMESPACES),
        key=st.sampled_from(KEYS),
        content=st.sampled_from(CONTENTS),
        cond=st.sampled_from([None, None, None, "nx", "xx"]),
    )
    def put(self, ns: str, key: str, content: bytes, cond: str | None) -> None:
        ref = (ns, key)
        res = self.s.put(ns, key, content, cond=cond)  # type: ignore[arg-type]
        old = self.data.get(ref)
        if old is None and cond == "xx":
            assert res.outcome is PutOutcome.MISSING
            assert not self.s.exists(ns, key)
            return
        if old is not None and (cond == "nx" or old == content):
            expected = PutOutcome.CONFLICT if cond == "nx" else PutOutcome.DUPLICATE
            assert res.outcome is expected
            assert res.digest == blake3.blake3(old).digest()
            assert res.size == len(old)
            self.count(ns, "put_conflicts" if cond == "nx" else "dedup_hits")
            return
        assert res.outcome is (PutOutcome.NEW if old is None else PutOutcome.REPLACED)
        assert res.digest == blake3.blake3(content).digest()
        assert res.size == len(content)
        self.data[ref] = content
        self.count(ns, "put_new" if old is None else "put_replaced")
        if len(self.same_blob(ref)) > 1:
            self.count(ns, "dedup_hits")
        else:
            self.hot.add(self.scope_of(ref))

    @rule(ns=st.sampled_from(NAMESPACES))
    def flush(self, ns: str) -> None:
        mine = [r for r in self.data if r[0] == ns]
        assert self.s.flush(ns) == len(mine)
        for r in mine:
            del self.data[r]
            self.pins.pop(r, None)
        assert self.s.count(ns) == 0

    @rule(ns=st.sampled_from(NAMESPACES), key=st.sampled_from(KEYS))
    def get(self, ns: str, key: str) -> None:
        got = self.s.get(ns, key)
        want = self.data.get((ns, key))
        if want is None:
            assert got is None
            self.count(ns, "get_misses")
        else:
            assert got is not None
            assert bytes(got) == want
            self.count(ns, "get_hits")
            self.touch((ns, key))
        assert self.s.exists(ns, key) is (want is not None)
        assert self.s.size(ns, key) == (None if want is None else len(want))

    @rule(ns=st.sampled_from(NAMESPACES), key=st.sampled_from(KEYS))
    def delete(self, ns: str, key: str) -> None:
        ref = (ns, key)
        assert self.s.delete(ns, key) is (ref in self.data)
        self.data.pop(ref, None)
        self.pins.pop(ref, None)

    @rule(ns=st.sampled_from(NAMESPACES), key=st.sampled_from(KEYS))
    def pin(self, ns: str, key: str) -> None:
        ref = (ns, key)
        assert self.s.pin(ns, key) is (ref in self.data)
        if ref in self.data:
            self.pins[ref] = self.pins.get(ref, 0) + 1

    @rule(ns=st.sampled_from(NAMESPACES), key=st.sampled_from(KEYS))
    def unpin(self, ns: str, key: str) -> None:
        ref = (ns, key)
        n = self.pins.get(ref, 0)
        assert self.s.unpin(ns, key) is (n > 0)
        if n > 1:
            self.pins[ref] = n - 1
        else:
            self.pins.pop(ref, None)

    @rule(ns=st.sampled_from(NAMESPACES), key=st.sampled_from(KEYS))
    def evict(self, ns: str, key: str) -> None:
        ref = (ns, key)
        if ref not in self.data:
            assert self.s.evict(ns, key) is False
            return
        sharing = self.same_blob(ref)
        pinned = any(self.pins.get(r, 0) for r in sharing)
        assert self.s.evict(ns, key) is (not pinned)
        if pinned:
            return
        self.hot.discard(self.scope_of(ref))
        if self.durable:
            # the block leaves RAM only; each namespace holding it counts one eviction
            for owner in self.owners(ref):
                self.count(owner, "evictions")
            assert self.s.exists(ns, key)
        else:
            # no lower tier: the block and every key that shares it are gone
            for r in sharing:
                del self.data[r]
                self.count(r[0], "evictions")
            assert self.s.get(ns, key) is None
            self.count(ns, "get_misses")

    @precondition(lambda self: self.durable)
    @rule(how=st.sampled_from(["close", "crash", "rebuild"]))
    def reopen(self, how: str) -> None:
        """Close and open again: cleanly; as after a crash with the index behind the log
        (the tail is replayed); or with the index deleted and rebuilt from the log."""
        assert isinstance(self.store, SharedKvStoreBackend)
        if how == "crash":
            self.store._close_without_checkpoint()
        else:
            self.s.close()
        if how == "rebuild":
            assert self.tmpdir is not None
            shutil.rmtree(f"{self.tmpdir}/index")
        self.store = self.open_store(rebuild=how == "rebuild")
        self.counters = {ns: Counter() for ns in NAMESPACES}
        self.hot.clear()

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if self.store is None:
            return
        report = self.s.check(deep=True)
        assert report.ok, report
        assert report.keys == len(self.data)
        assert report.blocks == len({self.scope_of(r) for r in self.data})

    @invariant()
    def stats_match_model(self) -> None:
        if self.store is None:
            return
        total_blobs: set[tuple[str, bytes]] = set()
        total_pinned: set[tuple[str, bytes]] = set()
        sums: Counter[str] = Counter()
        for ns in NAMESPACES:
            refs = [r for r in self.data if r[0] == ns]
            blobs = {self.scope_of(r) for r in refs}
            pinned = {self.scope_of(r) for r in self.pins if self.pins[r] > 0}
            ns_pinned = {b for b in blobs if b in pinned}
            total_blobs |= blobs
            total_pinned |= ns_pinned
            logical = sum(len(self.data[r]) for r in refs)
            resident = sum(len(b[1]) for b in blobs)
            st_ = self.s.stats(ns)
            want = {
                "total_refs": len(refs),
                "logical_bytes": logical,
                "unique_blocks": len(blobs),
                "resident_bytes": resident,
                "dedup_savings_bytes": logical - resident,
                "pinned_blocks": len(ns_pinned),
                **{
                    name: self.counters[ns][name]
                    for name in (
                        "put_new",
                        "dedup_hits",
                        "put_conflicts",
                        "put_replaced",
                        "get_hits",
                        "get_misses",
                        "evictions",
                        *(() if self.pressure else ("promotions", "demotions")),
                    )
                },
            }
            got = {name: getattr(st_, name) for name in want}
            assert got == want, (ns, got, want)
            assert st_.integrity_failures == 0
            assert st_.extra == {}, "tenant stats must not carry store-wide counters"
            tiers = st_.tiers
            if self.durable:
                assert (tiers["cold"].blocks, tiers["cold"].bytes) == (len(blobs), resident)
            sums.update(want)
            if self.pressure:
                assert tiers["hot"].blocks + tiers["warm"].blocks <= len(blobs)
                continue
            # without pressure nothing is in warm; hot holds what was written or read
            # since the last evict/reopen; durable: every block is also on disk
            hot = blobs & self.hot
            assert (tiers["hot"].blocks, tiers["hot"].bytes) == (
                len(hot),
                sum(len(b[1]) for b in hot),
            )
            assert (tiers["warm"].blocks, tiers["warm"].bytes) == (0, 0)
        total = self.s.stats(None)
        assert total.total_refs == len(self.data)
        assert total.logical_bytes == sums["logical_bytes"]
        assert total.unique_blocks == len(total_blobs)
        assert total.resident_bytes == sum(len(b[1]) for b in total_blobs)
        assert total.pinned_blocks == len(total_pinned)
        for name in (
            "put_new",
            "dedup_hits",
            "put_conflicts",
            "put_replaced",
            "get_hits",
            "get_misses",
        ):
            assert getattr(total, name) == sums[name], name
        if not self.pressure:
            assert total.tiers["hot"].blocks == len(total_blobs & self.hot)
        else:
            assert total.tiers["warm"].bytes <= total.tiers["warm"].capacity_bytes
        if self.durable:
            assert total.tiers["cold"].blocks == total.unique_blocks
            assert total.tiers["cold"].bytes == total.resident_bytes


class MemoryModel(StoreModel):
    durable = False

    def open_store(self, *, rebuild: bool = False) -> SharedKvBackend:
        return SharedKvIndex(StoreOptions(dedup_scope=self.scope))  # type: ignore[arg-type]


class DurableModel(StoreModel):
    durable = True

    def open_store(self, *, rebuild: bool = False) -> SharedKvBackend:
        assert self.tmpdir is not None
        return SharedKvStoreBackend(
            self.tmpdir,
            StoreOptions(
                dedup_scope=self.scope,  # type: ignore[arg-type]
                map_size_bytes=64 << 20,
                segment_bytes=64 << 10,  # small segments: rollover and segment deletion happen
                checkpoint_interval_s=0.05,  # checkpoints land between steps, or lag behind
                rebuild_index=rebuild,
            ),
        )


class DurableUnderPressureModel(DurableModel):
    """Hot and warm hold a block or two: blocks move between tiers on every step, and
    must still read back exactly (the cold tier has room for everything)."""

    pressure = True

    def open_store(self, *, rebuild: bool = False) -> SharedKvBackend:
        assert self.tmpdir is not None
        return SharedKvStoreBackend(
            self.tmpdir,
            StoreOptions(
                dedup_scope=self.scope,  # type: ignore[arg-type]
                hot_capacity_bytes=8 << 10,
                warm_capacity_bytes=6 << 10,
                map_size_bytes=64 << 20,
                segment_bytes=64 << 10,
                checkpoint_interval_s=0.05,
                rebuild_index=rebuild,
            ),
        )


_SETTINGS = settings(
    max_examples=int(os.environ.get("KVCACHE_MODEL_EXAMPLES", "30")),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestMemoryBackendModel = MemoryModel.TestCase
TestMemoryBackendModel.settings = _SETTINGS
TestDurableBackendModel = DurableModel.TestCase
TestDurableBackendModel.settings = _SETTINGS
TestDurableUnderPressureModel = DurableUnderPressureModel.TestCase
TestDurableUnderPressureModel.settings = _SETTINGS

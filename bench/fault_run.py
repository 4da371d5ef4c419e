"""A fault run over the durable store: damage a persist dir every way an operator or a
disk can, then start it, check it and rebuild it, in separate processes, and compare.

Each case starts from the same store (keys written by a real process, the last batches
left to the log tail by SIGKILL), applies one kind of damage, and records:
- start:   what a fresh process opening the store does (ok / refused with the rebuild
           hint / died by a signal / other error), twice (a second start after the first);
- check:   `epistemic-kvcache store check` (OK / PROBLEMS, or a signal);
- rebuild: `store rebuild-index`, then a start: keys served exactly, keys lost, keys
           served wrong (must be 0), keys the rebuild reported as lost.

Usage: python -m bench.fault_run [--keys N] [--out results.md] [--only CASE ...]

Prints one markdown row per case: what is expected, what the two starts did (with what
the first one served), what `store check` said, how many keys the rebuild named as lost,
and what a start after the rebuild served (exact / missing / wrong / deleted keys back).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path

import blake3

NS = "tenant"
CLI = [sys.executable, "-m", "epistemic_kvcache"]


def content(key: str) -> bytes:
    h = blake3.blake3(key.encode()).digest()
    return blake3.blake3(b"v:" + key.encode()).digest(length=1000 + (h[0] << 8))


WRITER = textwrap.dedent(
    """
    import os, sys
    from epistemic_kvcache.options import StoreOptions
    from epistemic_kvcache.store import SharedKvStoreBackend
    sys.path.insert(0, sys.argv[3])
    from fault_run import content
    n = int(sys.argv[2])
    s = SharedKvStoreBackend(sys.argv[1], StoreOptions(map_size_bytes=256 << 20,
                             segment_bytes=1 << 20, checkpoint_interval_s=3600))
    for i in range(n):
        s.put("tenant", f"k{i}", content(f"k{i}"))
        if i == n * 3 // 4:
            s.checkpoint()  # the last quarter stays in the log tail only
    for i in range(0, n, 10):
        s.delete("tenant", f"k{i}")
    print("written", flush=True)
    os.kill(os.getpid(), 9)
    """
)

READER = textwrap.dedent(
    """
    import sys, json
    from epistemic_kvcache.options import StoreOptions
    from epistemic_kvcache.store import SharedKvStoreBackend
    sys.path.insert(0, sys.argv[3])
    from fault_run import content
    s = SharedKvStoreBackend(sys.argv[1], StoreOptions(map_size_bytes=256 << 20, segment_bytes=1 << 20))
    ok = wrong = missing = 0
    for key in sys.argv[2].split(","):
        s.evict("tenant", key)
        got = s.get("tenant", key)
        if got is None:
            missing += 1
        elif bytes(got) == content(key):
            ok += 1
        else:
            wrong += 1
    extra = s.stats(None).extra
    print(json.dumps({"ok": ok, "wrong": wrong, "missing": missing,
                      "lost_keys": extra["lost_keys"], "repairs": extra["index_repairs"],
                      "quarantined": extra["quarantined_blocks"]}))
    s.close()
    """
)


def run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH", "")])),
    }
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"


def outcome(p: subprocess.CompletedProcess[str]) -> str:
    if p.returncode < 0:
        return f"SIGNAL {signal.Signals(-p.returncode).name}"
    if p.returncode == 0:
        return "ok"
    last = (p.stderr.strip().splitlines() or [""])[-1]
    if "rebuild-index" in last:
        return "refused (rebuild hint)"
    return "error: " + last[-80:]


def served_summary(d: dict[str, int]) -> str:
    """What a start served, from the reader's JSON line: exact keys, then what was not."""
    others = {"missing": "missing", "wrong": "wrong", "lost_keys": "named lost",
              "quarantined": "quarantined", "repairs": "repaired"}  # fmt: skip
    return ", ".join([f"{d['ok']} exact", *(f"{d[k]} {w}" for k, w in others.items() if d[k])])


HEAD = (
    "| case | expected | start (both) | `store check` | lost keys the rebuild names "
    "| after the rebuild: exact / missing / wrong / deleted keys back |\n"
    "|---|---|---|---|---|---|"
)


def segs(path: Path) -> list[Path]:
    return sorted((path / "segments").glob("*.seg"))


def flip(p: Path, at: int) -> None:
    with p.open("r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))


def records_of(path: Path, op: str) -> list[tuple[Path, int, int]]:
    sys.path.insert(0, str(SRC))
    from epistemic_kvcache.store.records import Op
    from epistemic_kvcache.store.scan import Scanned, scan
    from epistemic_kvcache.store.segments import Segment

    out = []
    for p in segs(path):
        for item in scan(Segment(int(p.stem), p, create=False), 0, payloads=False, verify=False):
            if isinstance(item, Scanned) and item.rec.op is Op[op]:
                out.append((p, item.off, item.rec.hlen))
    return out


def index_file(path: Path) -> Path:
    return path / "index" / "data.mdb"


Damage = Callable[[Path, random.Random], None]


def d_none(path: Path, rng: random.Random) -> None:
    pass


def d_index_deleted(path: Path, rng: random.Random) -> None:
    shutil.rmtree(path / "index")


def d_index_truncated(path: Path, rng: random.Random) -> None:
    f = index_file(path)
    os.truncate(f, f.stat().st_size // 3)


def d_index_zeroed_page(path: Path, rng: random.Random) -> None:
    f = index_file(path)
    pages = f.stat().st_size // 4096
    with f.open("r+b") as fh:
        fh.seek(rng.randrange(2, pages) * 4096)
        fh.write(bytes(4096))


def d_index_flips(n: int) -> Damage:
    def damage(path: Path, rng: random.Random) -> None:
        f = index_file(path)
        raw = bytearray(f.read_bytes())
        used = [i for i, c in enumerate(raw) if c]
        for _ in range(n):
            raw[rng.choice(used)] ^= 1 << rng.randrange(8)
        f.write_bytes(raw)

    return damage


def d_index_meta_zeroed(path: Path, rng: random.Random) -> None:
    with index_file(path).open("r+b") as fh:
        fh.write(bytes(4096))


def d_index_garbage(path: Path, rng: random.Random) -> None:
    f = index_file(path)
    f.write_bytes(os.urandom(f.stat().st_size))


def d_key_headers(n: int) -> Damage:
    def damage(path: Path, rng: random.Random) -> None:
        for p, off, _h in rng.sample(records_of(path, "KEY"), n):
            flip(p, off + 30)

    return damage


def d_blob_headers(n: int) -> Damage:
    def damage(path: Path, rng: random.Random) -> None:
        for p, off, _h in rng.sample(records_of(path, "BLOB"), n):
            flip(p, off + 30)

    return damage


def d_blob_payloads(n: int) -> Damage:
    def damage(path: Path, rng: random.Random) -> None:
        for p, off, hlen in rng.sample(records_of(path, "BLOB"), n):
            flip(p, off + hlen + 500)

    return damage


def d_del_headers(path: Path, rng: random.Random) -> None:
    for p, off, _h in rng.sample(records_of(path, "DEL"), 2):
        flip(p, off + 30)


def d_segment_truncated(path: Path, rng: random.Random) -> None:
    p = segs(path)[0]
    os.truncate(p, p.stat().st_size // 2)


def d_last_segment_truncated(path: Path, rng: random.Random) -> None:
    p = segs(path)[-1]
    os.truncate(p, p.stat().st_size - 3000)


def d_segment_deleted(path: Path, rng: random.Random) -> None:
    segs(path)[1].unlink()


def d_segment_zeroed_page(path: Path, rng: random.Random) -> None:
    p = segs(path)[1]
    with p.open("r+b") as fh:
        fh.seek(rng.randrange(1, p.stat().st_size // 4096) * 4096)
        fh.write(bytes(4096))


def d_segment_garbage_appended(path: Path, rng: random.Random) -> None:
    with segs(path)[-1].open("ab") as fh:
        fh.write(os.urandom(10_000))


def d_stray_file(path: Path, rng: random.Random) -> None:
    (path / "segments" / "99999999.seg").write_bytes(os.urandom(5000))


CASES: list[tuple[str, Damage, str]] = [
    ("nothing (SIGKILL only)", d_none, "start ok, every key exact"),
    ("index deleted", d_index_deleted, "refused; rebuild: every key"),
    ("index truncated to 1/3", d_index_truncated, "refused; rebuild: every key"),
    ("index meta page zeroed", d_index_meta_zeroed, "refused; rebuild: every key"),
    ("index page zeroed", d_index_zeroed_page, "refused or ok-exact; rebuild: every key"),
    ("index: 1 byte flipped", d_index_flips(1), "refused or ok-exact; rebuild: every key"),
    ("index: 10 bytes flipped", d_index_flips(10), "refused or ok-exact; rebuild: every key"),
    ("index: 200 bytes flipped", d_index_flips(200), "refused or ok-exact; rebuild: every key"),
    ("index garbage", d_index_garbage, "refused; rebuild: every key"),
    ("3 KEY headers flipped", d_key_headers(3), "start ok; rebuild restores from old index"),
    ("3 BLOB headers flipped", d_blob_headers(3), "3 keys lost, named; none wrong"),
    ("3 BLOB payloads flipped", d_blob_payloads(3), "3 keys lost (quarantined), none wrong"),
    ("2 DEL headers flipped", d_del_headers, "no deleted key resurrected silently"),
    ("first segment cut in half", d_segment_truncated, "its keys lost, named; none wrong"),
    ("last segment's tail cut", d_last_segment_truncated, "tail keys lost, named; none wrong"),
    ("a segment deleted", d_segment_deleted, "its keys lost, named; none wrong"),
    ("a segment page zeroed", d_segment_zeroed_page, "keys in it lost, named; none wrong"),
    ("garbage appended to the log", d_segment_garbage_appended, "start ok, every key exact"),
    ("stray segment file", d_stray_file, "refused (other store) or ignored; none wrong"),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--keys", type=int, default=600)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", action="append", choices=[c[0] for c in CASES], help="this case")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="fault-run-"))
    base = work / "base"
    w = run([sys.executable, "-c", WRITER, str(base), str(args.keys), str(HERE)])
    assert w.returncode == -9, w.stderr
    assert "written" in w.stdout, w.stderr
    live = [f"k{i}" for i in range(args.keys) if i % 10]
    deleted = [f"k{i}" for i in range(0, args.keys, 10)]
    rows: list[str] = []
    for name, damage, expected in CASES:
        if args.only and name not in args.only:
            continue
        d = work / "case"
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(base, d)
        damage(d, random.Random(args.seed))
        starts = [
            outcome(run([sys.executable, "-c", READER, str(d), ",".join(live), str(HERE)]))
            for _ in range(2)
        ]
        first = run([sys.executable, "-c", READER, str(d), ",".join(live), str(HERE)])
        start = starts[0] if starts[0] == starts[1] else f"{starts[0]}, then {starts[1]}"
        if first.returncode == 0:
            start += ": " + served_summary(json.loads(first.stdout.strip().splitlines()[-1]))
        chk = run([*CLI, "store", "check", "--persist-dir", str(d)])
        check = (
            outcome(chk)
            if chk.returncode < 0
            else chk.stdout.strip().splitlines()[-1].split(" (")[0]
        )
        rb = run([*CLI, "store", "rebuild-index", "--persist-dir", str(d)])
        reported = "?"
        for line in rb.stdout.splitlines():
            if "keys whose bytes are gone" in line:
                reported = line.split("keys whose bytes are gone: ")[1].split(",")[0]
        after = run([sys.executable, "-c", READER, str(d), ",".join(live), str(HERE)])
        dead = run([sys.executable, "-c", READER, str(d), ",".join(deleted), str(HERE)])
        a = json.loads(after.stdout.strip().splitlines()[-1]) if after.returncode == 0 else {}
        z = json.loads(dead.stdout.strip().splitlines()[-1]) if dead.returncode == 0 else {}
        if outcome(rb) != "ok":
            reported = f"{reported} (rebuild: {outcome(rb)})"
        after = (
            f"{a.get('ok', '?')} / {a.get('missing', '?')} / {a.get('wrong', '?')} / "
            f"{z.get('ok', 0) + z.get('wrong', 0)}"
        )
        row = f"| {name} | {expected} | {start} | {check} | {reported} | {after} |"
        rows.append(row)
        print(row, flush=True)
    text = "\n".join([HEAD, *rows])
    if args.out:
        args.out.write_text(text + "\n")
    print()
    print(text)
    shutil.rmtree(work)


if __name__ == "__main__":
    main()

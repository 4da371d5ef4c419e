"""The inputs of the multi-loop scaling prediction (issue 26 item 5), and the prediction.

    PYTHONPATH=src python -m bench.bench_scaling_inputs [--sizes 256KiB,4MiB,32MiB]
        [--wires resp,http] [--ops set,get] [--conns 4] [--seconds 6] [--event-loops 1]

How it works
------------
Today's server (one event loop, `serve --backend memory --event-loops 1`: the default is a
loop per core, and the prediction starts from one; a child process) is driven by
the bench load generator (bench/loadgen.py, in this process: unique payloads, one
request in flight per connection) with GET or SET at each size, over the RESP wire and
over HTTP, for `--seconds` per cell (whole passes, keys written before a GET cell
starts). Per cell, from /proc/<pid>/task/<tid>/stat before and after: the event-loop
thread's CPU (the main thread of `serve`: tid == pid) and the whole process's, in
CPU-seconds per GB moved; and, from py-spy (`record --gil` samples only the thread
holding the GIL) or perf (below), the seconds the GIL was held by the loop thread and
by the other threads.

The prediction for N loops over one store in one process (one GIL), in GB/s, the least of:
- Amdahl: the loops' GIL-held parts queue, the rest overlaps:
  1 / (loop CPU-s/GB x (s + (1 - s) / N)), s = the loop thread's GIL-held share of its
  CPU;
- the cores: C / (whole-process CPU-s/GB);
- the GIL: 1 / (GIL-held s/GB of every thread: s x loop CPU + the other threads').
The speedup is that over the same for N = 1. Printed: the measured table, then the
speedup for N = 1, 2, 4, 8, 16 on `--cores` cores (and on this machine's), with the
measured s and with s_lo (the loop thread's user-mode share: as if every kernel copy it
makes ran without the GIL; true of uvloop's reads, not of its first write(2) of a reply,
which it makes holding the GIL).

GIL-held time, `--gil perf` (the default as root with perf): uprobes on the
interpreter's `take_gil` (return) and `drop_gil` (entry) and `sched:sched_switch`,
recorded system-wide for the cell; the loop thread's on-CPU seconds while holding the
GIL over its on-CPU seconds is s (a holder preempted by another process, common on a
loaded machine, is not counted as running). `--gil py-spy`: `py-spy record --gil`
samples, which count a preempted holder as holding: an over-count on a busy machine,
capped at the CPU time. The /proc columns are exact either way.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench import loadgen
from bench.bench_core import OUR_OPTIONS
from bench.bench_cpu import parse_size, pid_listening, thread_cpu
from bench.bench_server import TOKEN, human, our_server, workload

MiB = 1024 * 1024
PYSPY_RATE = 200
LOOPS = (1, 2, 4, 8, 16)


@dataclass
class Cell:
    wire: str
    op: str
    size: int
    gb: float
    wall: float
    ops: int
    loop_cpu: float
    loop_sys: float
    proc_cpu: float
    gil_loop: float
    gil_other: float
    measured_s: float | None = None
    """perf: the loop thread's on-CPU seconds holding the GIL / its on-CPU seconds, both
    from the same record (None with py-spy)."""

    @property
    def s_lo(self) -> float:
        """The serial fraction if every kernel second of the loop thread ran without the
        GIL (true of uvloop's reads, not of its first write of a reply): its user share."""
        return (self.loop_cpu - self.loop_sys) / self.loop_cpu if self.loop_cpu else 1.0

    @property
    def s_hi(self) -> float:
        """The serial fraction py-spy saw: the loop thread's GIL-held share of its CPU
        (an over-count where the holder is preempted: a loaded machine)."""
        if self.measured_s is not None:
            return self.measured_s
        spy = min(1.0, self.gil_loop / self.loop_cpu) if self.loop_cpu else 1.0
        return max(spy, self.s_lo)

    def throughput(self, n: int, cores: int, s: float) -> float:
        """Predicted GB/s of `n` loops on `cores` cores with serial fraction `s`: the
        least of Amdahl (the loops' GIL-held parts queue, the rest overlaps), the cores
        (each GB costs the whole process's CPU), and the GIL (every thread's held time
        queues on it)."""
        amdahl = 1 / (self.loop_cpu / self.gb * (s + (1 - s) / n))
        cores_cap = cores / (self.proc_cpu / self.gb)
        gil = (s * self.loop_cpu + self.gil_other) / self.gb
        return min(amdahl, cores_cap, 1 / gil if gil else amdahl)

    def speedup(self, n: int, cores: int, s: float) -> float:
        """Predicted throughput of `n` loops over one loop's, on the same machine."""
        return self.throughput(n, cores, s) / self.throughput(1, cores, s)


def gil_samples(raw: Path) -> tuple[float, float]:
    """Seconds the GIL was held by (the loop thread, other threads), from py-spy's raw
    output (`frame;frame;... count` per line, the outermost frame first)."""
    loop = other = 0
    if raw.exists():
        for line in raw.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            if "(threading.py" in stack.split(";", 2)[0] or "_bootstrap (" in stack:
                other += int(count)
            else:
                loop += int(count)
    return loop / PYSPY_RATE, other / PYSPY_RATE


PROBES = ("take_gil%return", "drop_gil")


def libpython_of(pid: int) -> str:
    """The file holding the interpreter's `take_gil` (libpython, or the executable)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        path = line.split()[-1]
        if "libpython3" in path and path.endswith((".so", ".so.1.0")):
            return path
    return os.readlink(f"/proc/{pid}/exe")


@contextlib.contextmanager
def gil_probes(pid: int) -> Iterator[None]:
    """uprobes on the interpreter's `take_gil` (return: the GIL is held) and `drop_gil`
    (entry: it is let go), removed afterwards. Needs root and `perf`."""
    lib = libpython_of(pid)
    drop = ["perf", "probe", "-q", "-d", "probe_libpython3:*"]
    subprocess.run(drop, check=False, stderr=subprocess.DEVNULL)  # left by an earlier run
    for probe in PROBES:
        subprocess.run(["perf", "probe", "-q", "-x", lib, "-a", probe], check=True)
    try:
        yield
    finally:
        subprocess.run(drop, check=False)


def gil_by_perf(data: Path, tids: set[int]) -> dict[int, tuple[float, float]]:
    """Per thread of `tids`: (seconds on a CPU, seconds on a CPU while holding the GIL),
    from a `perf record -a` of the GIL probes and `sched:sched_switch`: the intersection
    of the GIL-held intervals with the on-CPU intervals (a holder preempted by another
    process is not counted as running)."""
    out = subprocess.run(
        ["perf", "script", "-i", str(data), "-F", "tid,time,event,trace"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    on: dict[int, float] = {}  # tid -> when it went on a CPU (absent: off)
    held: dict[int, float] = {}  # tid -> when it took the GIL (absent: not held)
    oncpu = dict.fromkeys(tids, 0.0)
    both = dict.fromkeys(tids, 0.0)
    mark: dict[int, float] = {}  # tid -> start of the current on-CPU-and-holding stretch

    def stretch_end(tid: int, t: float) -> None:
        if tid in mark:
            both[tid] += t - mark.pop(tid)

    def stretch_start(tid: int, t: float) -> None:
        if tid in on and tid in held:
            mark[tid] = t

    for line in out.splitlines():
        parts = line.split(None, 3)
        if len(parts) < 3:
            continue
        tid, t, event = int(parts[0]), float(parts[1].rstrip(":")), parts[2]
        if event.startswith("sched:sched_switch"):
            trace = parts[3] if len(parts) > 3 else ""
            prev = int(trace.split("prev_pid=")[1].split()[0])
            nxt = int(trace.split("next_pid=")[1].split()[0])
            if prev in tids and prev in on:
                oncpu[prev] += t - on.pop(prev)
                stretch_end(prev, t)
            if nxt in tids:
                on[nxt] = t
                stretch_start(nxt, t)
        elif tid in tids and "take_gil" in event:
            held[tid] = t
            on.setdefault(tid, t)  # running now (its switch-in may predate the record)
            stretch_start(tid, t)
        elif tid in tids and "drop_gil" in event:
            on.setdefault(tid, t)
            stretch_end(tid, t)
            held.pop(tid, None)
    return {tid: (oncpu[tid], both[tid]) for tid in tids}


def cpu_since(pid: int, before: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """(utime, stime) each thread of `pid` used since `before` (a `thread_cpu` reading)."""
    return {
        tid: (now[0] - before.get(tid, (0.0, 0.0))[0], now[1] - before.get(tid, (0.0, 0.0))[1])
        for tid, now in thread_cpu(pid).items()
    }


def cell(
    spy: str | None,
    tmp: Path,
    rport: int,
    hport: int,
    wire: str,
    op: str,
    size: int,
    a: argparse.Namespace,
) -> Cell:
    pid = pid_listening(rport)
    conns = a.conns
    budget = max(conns * size * 4, a.pass_mib * MiB)

    def drive(kind: str, keys: list[bytes], payloads: list[bytes]) -> loadgen.Result:
        if wire == "resp":
            return loadgen.run(
                loadgen.run_resp("127.0.0.1", rport, TOKEN, kind, keys, payloads, conns)
            )
        return loadgen.run(loadgen.run_http("127.0.0.1", hport, TOKEN, kind, keys, payloads, conns))

    keys, payloads = workload(size, budget, conns)
    if op == "get":
        drive("set", keys, payloads)
    raw = tmp / f"gil-{wire}-{op}-{size}.txt"
    raw.unlink(missing_ok=True)
    t0 = thread_cpu(pid)
    started = time.time()
    if a.gil == "perf":
        events = ["-e", "probe_libpython3:take_gil__return", "-e", "probe_libpython3:drop_gil"]
        sampler = subprocess.Popen(
            ["perf", "record", "-q", "-a", "-o", str(raw), *events, "-e", "sched:sched_switch",
             "--", "sleep", str(a.seconds)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    else:
        sampler = subprocess.Popen(
            [str(spy), "record", "--pid", str(pid), "--gil", "--nonblocking", "-r", str(PYSPY_RATE),
             "-d", str(int(a.seconds)), "--format", "raw", "-o", str(raw)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
    passes: list[loadgen.Result] = []
    while time.time() - started < a.seconds:
        if op == "set":  # fresh keys and bytes for every pass
            keys, payloads = workload(size, budget, conns)
        passes.append(drive(op, keys, payloads))
    wall = time.time() - started
    delta = cpu_since(pid, t0)
    sampler.wait()
    nbytes, ops = sum(r.nbytes for r in passes), sum(r.ops for r in passes)
    loop_u, loop_s = delta.get(str(pid), (0.0, 0.0))
    proc = sum(u + st for u, st in delta.values())
    if a.gil == "perf":
        by_tid = gil_by_perf(raw, {int(t) for t in delta})
        loop_on, loop_both = by_tid.get(pid, (0.0, 0.0))
        measured = loop_both / loop_on if loop_on else None
        # the record covers `a.seconds` of the cell: GIL seconds scaled to the whole cell
        go = sum(both for tid, (_, both) in by_tid.items() if tid != pid) * wall / a.seconds
        gl = (measured or 0.0) * (loop_u + loop_s)
    else:
        measured = None
        gl, go = gil_samples(raw)
    # the sampler can over-count in a busy VM: never more than the CPU time
    gl = min(gl, loop_u + loop_s)
    go = min(go, proc - loop_u - loop_s)
    return Cell(
        wire, op, size, nbytes / 1e9, wall, ops, loop_u + loop_s, loop_s, proc, gl, go, measured
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256KiB,4MiB,32MiB")
    p.add_argument("--wires", default="resp,http")
    p.add_argument("--ops", default="set,get")
    p.add_argument("--conns", type=int, default=4)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--pass-mib", type=int, default=256, help="bytes per load-generator pass")
    p.add_argument("--cores", type=int, default=16, help="the machine the prediction is for")
    p.add_argument(
        "--event-loops", type=int, default=1, help="the server's loops (the prediction's N = 1)"
    )
    p.add_argument(
        "--gil",
        choices=("perf", "py-spy"),
        default="perf" if os.geteuid() == 0 and shutil.which("perf") else "py-spy",
        help="how the GIL-held time is measured (perf: uprobes, root; py-spy: sampling)",
    )
    a = p.parse_args(argv)
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None and a.gil == "py-spy":
        raise SystemExit("needs py-spy (pip install 'epistemic-kvcache[dev]') or perf as root")
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    here = len(os.sched_getaffinity(0))
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min), usable cores: {here}, "
          f"{a.conns} connections, {a.seconds:.0f} s per cell, memory backend\n")  # fmt: skip
    cells: list[Cell] = []
    tmp = Path(tempfile.mkdtemp(prefix="kvbench-scaling-"))
    try:
        options = (*OUR_OPTIONS, "--event-loops", str(a.event_loops))
        with (
            our_server(tmp, "memory", options=options) as (hport, rport),
            contextlib.ExitStack() as probes,
        ):
            if a.gil == "perf":
                probes.enter_context(gil_probes(pid_listening(rport)))
            for wire in a.wires.split(","):
                for op in a.ops.split(","):
                    for size in sizes:
                        c = cell(spy, tmp, rport, hport, wire, op, size, a)
                        cells.append(c)
                        print(f"  {wire} {op} {human(size)}: {c.gb / c.wall:.2f} GB/s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nload after: {os.getloadavg()[0]:.2f} (1-min)\n")
    print("| wire | op | block | GB/s | loop-thread CPU-s/GB (of it kernel) | process CPU-s/GB "
          "| GIL held, loop thread, s/GB | GIL held, other threads, s/GB "
          "| s_lo = loop user / loop CPU | s = loop GIL / loop CPU (measured) "
          "| loop CPU / process CPU |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        print(f"| {c.wire} | {c.op.upper()} | {human(c.size)} | {c.gb / c.wall:.2f} "
              f"| {c.loop_cpu / c.gb:.3f} ({c.loop_sys / c.gb:.3f}) | {c.proc_cpu / c.gb:.3f} "
              f"| {c.gil_loop / c.gb:.3f} | {c.gil_other / c.gb:.3f} | {c.s_lo:.2f} | {c.s_hi:.2f} "
              f"| {c.loop_cpu / c.proc_cpu:.2f} |")  # fmt: skip
    for cores in (a.cores, here):
        for label, pick in (
            ("s measured (s_hi)", lambda c: c.s_hi),
            ("what if every kernel copy of the loop thread ran without the GIL (s_lo)",
             lambda c: c.s_lo),
        ):  # fmt: skip
            print(f"\npredicted speedup over one loop, {cores} cores, {label}; "
                  "the least of Amdahl, the cores and the GIL\n")  # fmt: skip
            print("| wire | op | block | s | " + " | ".join(f"N={n}" for n in LOOPS)
                  + f" | GB/s at N={LOOPS[-1]} |")  # fmt: skip
            print("|---|---|---|---|" + "---|" * (len(LOOPS) + 1))
            for c in cells:
                sv = pick(c)
                print(f"| {c.wire} | {c.op.upper()} | {human(c.size)} | {sv:.2f} | "
                      + " | ".join(f"{c.speedup(n, cores, sv):.1f}x" for n in LOOPS)
                      + f" | {c.throughput(LOOPS[-1], cores, sv):.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()

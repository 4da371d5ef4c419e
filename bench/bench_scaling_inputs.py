"""The inputs of the multi-loop scaling prediction (issue 26 item 5), and the prediction.

    PYTHONPATH=src python -m bench.bench_scaling_inputs [--sizes 256KiB,4MiB,32MiB]
        [--wires resp,http] [--ops set,get] [--conns 4] [--seconds 6]

How it works
------------
Today's server (one event loop, `serve --backend memory`, a child process) is driven by
the bench load generator (bench/loadgen.py, in this process: unique payloads, one
request in flight per connection) with GET or SET at each size, over the RESP wire and
over HTTP, for `--seconds` per cell (whole passes, keys written before a GET cell
starts). Per cell, from /proc/<pid>/task/<tid>/stat before and after: the event-loop
thread's CPU (the main thread of `serve`: tid == pid) and the whole process's, in
CPU-seconds per GB moved; and, from `py-spy record --gil` (samples only the thread
holding the GIL, at `PYSPY_RATE` Hz), the seconds the GIL was held, split into the
loop thread's (stacks not started by `threading`) and the other threads'.

The prediction for N loops over one store in one process (one GIL):
- Amdahl with the serial fraction s = GIL-held seconds / loop-thread CPU seconds (the
  part of one loop's work that cannot overlap with another loop's):
  speedup(N) = 1 / (s + (1 - s) / N).
- Capped by the cores: N loops need N x (whole-process CPU per request) of CPU, so on C
  cores speedup <= C x loop CPU / process CPU.
- Capped by the GIL outright: speedup <= loop CPU / all GIL-held seconds (the GIL is
  one resource every thread's held time queues on).
Printed: the measured table, then the predicted speedup for N = 1, 2, 4, 8, 16 with 16
cores (and with this machine's cores), per op and size. py-spy samples a busy VM
imperfectly (bench_cpu.py saw it over-count), so the GIL share is capped at the CPU
time and should be read as an estimate; the /proc columns are exact.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import loadgen
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

    @property
    def s(self) -> float:
        """The serial fraction: the loop thread's GIL-held share of its own CPU."""
        return min(1.0, self.gil_loop / self.loop_cpu) if self.loop_cpu else 1.0

    def speedup(self, n: int, cores: int) -> float:
        amdahl = 1 / (self.s + (1 - self.s) / n)
        core_cap = cores * self.loop_cpu / self.proc_cpu if self.proc_cpu else amdahl
        gil_total = self.gil_loop + self.gil_other
        gil_cap = self.loop_cpu / gil_total if gil_total else amdahl
        return min(amdahl, core_cap, gil_cap, float(n))


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


def cell(
    spy: str,
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
    sampler = subprocess.Popen(
        [spy, "record", "--pid", str(pid), "--gil", "--nonblocking", "-r", str(PYSPY_RATE),
         "-d", str(int(a.seconds)), "--format", "raw", "-o", str(raw)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    nbytes = ops = 0
    while time.time() - started < a.seconds:
        if op == "set":
            keys, payloads = workload(size, budget, conns)  # fresh keys and bytes each pass
        r = drive(op, keys, payloads)
        nbytes += r.nbytes
        ops += r.ops
    wall = time.time() - started
    t1 = thread_cpu(pid)
    sampler.wait()
    delta = {
        k: (u - t0.get(k, (0.0, 0.0))[0], st - t0.get(k, (0.0, 0.0))[1])
        for k, (u, st) in t1.items()
    }
    loop_u, loop_s = delta.get(str(pid), (0.0, 0.0))
    proc = sum(u + st for u, st in delta.values())
    gl, go = gil_samples(raw)
    # the sampler can over-count in a busy VM: never more than the CPU time
    gl = min(gl, loop_u + loop_s)
    go = min(go, proc - loop_u - loop_s)
    return Cell(wire, op, size, nbytes / 1e9, wall, ops, loop_u + loop_s, loop_s, proc, gl, go)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256KiB,4MiB,32MiB")
    p.add_argument("--wires", default="resp,http")
    p.add_argument("--ops", default="set,get")
    p.add_argument("--conns", type=int, default=4)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--pass-mib", type=int, default=256, help="bytes per load-generator pass")
    p.add_argument("--cores", type=int, default=16, help="the machine the prediction is for")
    a = p.parse_args(argv)
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        raise SystemExit("needs py-spy (pip install 'epistemic-kvcache[dev]')")
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    here = len(os.sched_getaffinity(0))
    print(f"load before: {os.getloadavg()[0]:.2f} (1-min), usable cores: {here}, "
          f"{a.conns} connections, {a.seconds:.0f} s per cell, memory backend\n")  # fmt: skip
    cells: list[Cell] = []
    tmp = Path(tempfile.mkdtemp(prefix="kvbench-scaling-"))
    try:
        with our_server(tmp, "memory") as (hport, rport):
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
          "| s = loop GIL / loop CPU | loop CPU / process CPU |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for c in cells:
        print(f"| {c.wire} | {c.op.upper()} | {human(c.size)} | {c.gb / c.wall:.2f} "
              f"| {c.loop_cpu / c.gb:.3f} ({c.loop_sys / c.gb:.3f}) | {c.proc_cpu / c.gb:.3f} "
              f"| {c.gil_loop / c.gb:.3f} | {c.gil_other / c.gb:.3f} | {c.s:.2f} "
              f"| {c.loop_cpu / c.proc_cpu:.2f} |")  # fmt: skip
    for cores in (a.cores, here):
        print(f"\npredicted speedup over one loop, {cores} cores "
              "(min of Amdahl, cores x loop/process CPU, loop CPU / all GIL time, N)\n")  # fmt: skip
        print("| wire | op | block | s | " + " | ".join(f"N={n}" for n in LOOPS) + " |")
        print("|---|---|---|---|" + "---|" * len(LOOPS))
        for c in cells:
            print(f"| {c.wire} | {c.op.upper()} | {human(c.size)} | {c.s:.2f} | "
                  + " | ".join(f"{c.speedup(n, cores):.1f}x" for n in LOOPS) + " |")  # fmt: skip


if __name__ == "__main__":
    main()

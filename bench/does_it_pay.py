"""Fetch from this server vs recompute on the GPU: from what prompt length does a hit pay?

    python -m bench.does_it_pay

Prints the table in docs/does-it-pay.md. Inputs, each named where it is used:
- KV bytes per token from each model's published `config.json` (layers, KV heads, head
  size; DeepSeek-V2-Lite caches MLA's compressed latent, `kv_lora_rank + qk_rope_head_dim`
  values per layer), bf16.
- Prefill cost: 2 FLOPs per active parameter per token plus causal attention
  (`layers * n^2 * heads * (d_qk + d_v)` FLOPs for an n-token prompt), on one NVIDIA
  H100/H200 SXM at its datasheet dense BF16 peak (989 TFLOPS) times an assumed model
  FLOPs utilisation `MFU` (0.5 here). Not measured: no GPU was available.
- Load throughput per path: our own measurements (docs/lmcache.md, "Throughput through
  each path": `python -m bench.bench_lmcache --backend durable`, loads of 4 x 32 MiB).
- A fixed cost per fetch (lookup + request round trips): `FIXED_S`.

A hit beats recomputing once fetching the prompt's KV takes less time than computing it:
`n * kv_bytes / B + FIXED_S < (2 * P * n + A * n^2) / F`; the smallest such n is printed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PEAK_FLOPS = 989e12  # H100 / H200 SXM, dense BF16, NVIDIA datasheet
MFU = 0.5
FIXED_S = 0.002  # lookup + round trips; lookups of 64 keys took 1-2 ms (docs/lmcache.md)

# GB/s (1e9 bytes/s), loads of 4 x 32 MiB chunks into the durable backend, docs/lmcache.md.
PATHS = {
    "MP native plugin": 1.78,
    "MP RESP adapter": 1.54,
    "v1 Path A": 1.52,
    "v1 resp://": 1.61,
    "v1 redis://": 0.15,
}


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    heads: int
    d_qk: int
    d_v: int
    kv_values_per_layer: int  # values cached per token per layer (K and V, or MLA latent)
    active_params: float

    @property
    def kv_bytes(self) -> int:
        return self.layers * self.kv_values_per_layer * 2  # bf16

    @property
    def attn_flops_coeff(self) -> float:
        """A in `A * n^2`: causal attention FLOPs of an n-token prefill."""
        return float(self.layers * self.heads * (self.d_qk + self.d_v))


MODELS = [
    # meta-llama/Meta-Llama-3-8B: 32 layers, 32 heads, 8 KV heads, head size 128.
    Model("Llama-3-8B", 32, 32, 128, 128, 2 * 8 * 128, 8.03e9),
    # meta-llama/Meta-Llama-3-70B: 80 layers, 64 heads, 8 KV heads, head size 128.
    Model("Llama-3-70B", 80, 64, 128, 128, 2 * 8 * 128, 70.6e9),
    # Qwen/Qwen2.5-7B: 28 layers, 28 heads, 4 KV heads, head size 128.
    Model("Qwen2.5-7B", 28, 28, 128, 128, 2 * 4 * 128, 7.62e9),
    # deepseek-ai/DeepSeek-V2-Lite: 27 layers, 16 heads, MLA (kv_lora_rank 512 +
    # qk_rope_head_dim 64 cached; q/k head 128+64, v head 128); 2.4B of 15.7B active.
    Model("DeepSeek-V2-Lite", 27, 16, 192, 128, 512 + 64, 2.4e9),
]


def breakeven(m: Model, gbps: float) -> float:
    """Smallest prompt length n where fetching beats recomputing (inf: never)."""
    f = PEAK_FLOPS * MFU
    a = m.attn_flops_coeff / f
    b = 2 * m.active_params / f - m.kv_bytes / (gbps * 1e9)
    c = -FIXED_S
    # a n^2 + b n + c >= 0, a > 0, c < 0: one positive root.
    return (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)


def main() -> None:
    f = PEAK_FLOPS * MFU
    print(
        f"prefill: {PEAK_FLOPS / 1e12:.0f} TFLOPS x MFU {MFU}; fixed cost per fetch {FIXED_S * 1e3:.0f} ms"
    )
    print()
    print(
        "| model | KV bytes/token | recompute tokens/s at 1k / 32k prompt | "
        + " | ".join(PATHS)
        + " |"
    )
    print("|---|---|---|" + "---|" * len(PATHS))
    for m in MODELS:

        def rate(n: int, m: Model = m) -> float:
            return n / ((2 * m.active_params * n + m.attn_flops_coeff * n * n) / f)

        cells = []
        for gbps in PATHS.values():
            n = breakeven(m, gbps)
            fetch_rate = gbps * 1e9 / m.kv_bytes
            cells.append(f"{n:,.0f} ({fetch_rate / 1e3:.1f}k tok/s)")
        print(f"| {m.name} | {m.kv_bytes:,} | {rate(1024) / 1e3:.1f}k / {rate(32768) / 1e3:.1f}k | " + " | ".join(cells) + " |")  # fmt: skip


if __name__ == "__main__":
    main()

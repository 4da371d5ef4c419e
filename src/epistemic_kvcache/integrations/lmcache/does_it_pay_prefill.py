"""The prefill half of `does-it-pay`: how long this machine takes to compute a prompt's KV.

A model of the given shape with random weights (the time of a prefill does not depend on
the weights' values) runs one forward pass over an n-token prompt on the best device
present (CUDA when torch sees one, else the CPU), in bf16 unless told otherwise:

- engine "transformers": the model class `transformers` builds for the shape's
  `model_type` (`AutoModelForCausalLM.from_config`, SDPA attention), called with
  `logits_to_keep=1` (the output layer on the last token only) and no KV cache kept;
- engine "torch": this module's own decoder stack of the same shape (RMSNorm, rotary
  embeddings, grouped-query attention through `scaled_dot_product_attention` with a
  causal mask, a gated SiLU MLP), the output layer on the last token only. The default
  where `transformers` is not installed.

When the weights (plus room for the longest prompt's activations) do not fit in the
device's free memory, or `max_layers` says so, only `measured_layers` of the model's
layers are built and each time is scaled by `layers / measured_layers`; the result says
so. Each length: warm-up runs, then the median of `repeats` timed runs (the device
synchronised around each); a length that runs out of memory is reported as such and
longer ones are not tried.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from epistemic_kvcache.errors import ConfigurationError
from epistemic_kvcache.integrations.lmcache.does_it_pay_models import ModelShape

ENGINES = ("auto", "torch", "transformers")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FREE_MEMORY_SHARE = 0.8
"""Of the device's free memory, what the weights and activations may take."""


@dataclass(slots=True)
class PrefillResult:
    """Measured (and, for a layer subset, scaled) prefill times of one model."""

    engine: str
    device: str
    dtype: str
    layers: int
    measured_layers: int
    why_subset: str | None
    points: list[dict[str, Any]] = field(default_factory=list)
    stopped: str | None = None

    @property
    def scaled(self) -> bool:
        return self.measured_layers != self.layers


def pick_device(wanted: str) -> torch.device:
    """`auto`: CUDA when present, else the CPU; `cuda` without CUDA is an error."""
    if wanted == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError("invalid device 'cuda': torch sees no CUDA device here")
    if wanted not in ("cpu", "cuda"):
        raise ConfigurationError(f"invalid device {wanted!r}: expected auto, cpu or cuda")
    return torch.device(wanted)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    import platform

    return f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def free_bytes(device: torch.device) -> int:
    """Free memory on `device` (the CPU: MemAvailable)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def activation_bytes(shape: ModelShape, n: int, bytes_per_value: int) -> int:
    """A generous bound on one layer's live activations for an n-token prompt."""
    width = (
        4 * shape.hidden
        + 3 * shape.intermediate
        + (shape.heads + 2 * shape.kv_heads) * 2 * shape.head_dim
    )
    return 2 * n * width * bytes_per_value


def layers_to_measure(
    shape: ModelShape,
    device: torch.device,
    dtype: torch.dtype,
    longest: int,
    max_layers: int | None,
) -> tuple[int, str | None]:
    """How many layers to build, and why fewer than all (None: all)."""
    size = torch.tensor([], dtype=dtype).element_size()
    per_layer = shape.layer_matrix_params() * size
    fixed = shape.weight_bytes(size) - shape.layers * per_layer
    room = (
        int(free_bytes(device) * FREE_MEMORY_SHARE) - fixed - activation_bytes(shape, longest, size)
    )
    fit = room // per_layer if per_layer else shape.layers
    if max_layers is not None and max_layers < min(fit, shape.layers):
        return max(1, max_layers), f"--layers {max_layers}"
    if fit >= shape.layers:
        return shape.layers, None
    if fit < 1:
        raise ConfigurationError(
            f"{shape.label}: not even one layer and a {longest}-token prompt fit in the "
            f"{free_bytes(device) / 1e9:.1f} GB free on {device}; try shorter --lengths"
        )
    gb = shape.weight_bytes(size) / 1e9
    return int(
        fit
    ), f"the whole model ({gb:.1f} GB of weights) does not fit in {device}'s free memory"


# -- the engines --------------------------------------------------------------------------
class _Layer(torch.nn.Module):
    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.s = s
        self.norm1 = torch.nn.RMSNorm(s.hidden, eps=1e-5)
        self.qkv = torch.nn.Linear(
            s.hidden, (s.heads + 2 * s.kv_heads) * s.head_dim, bias=s.qkv_bias
        )
        self.o = torch.nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)
        self.norm2 = torch.nn.RMSNorm(s.hidden, eps=1e-5)
        self.gate_up = torch.nn.Linear(s.hidden, 2 * s.intermediate, bias=False)
        self.down = torch.nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s, n = self.s, x.shape[1]
        q, k, v = self.qkv(self.norm1(x)).split(
            [s.heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1
        )
        q = _rope(q.view(1, n, s.heads, s.head_dim).transpose(1, 2), cos, sin)
        k = _rope(k.view(1, n, s.kv_heads, s.head_dim).transpose(1, 2), cos, sin)
        v = v.view(1, n, s.kv_heads, s.head_dim).transpose(1, 2)
        a = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=s.kv_heads != s.heads
        )
        x = x + self.o(a.transpose(1, 2).reshape(1, n, s.heads * s.head_dim))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        out: torch.Tensor = x + self.down(torch.nn.functional.silu(gate) * up)
        return out


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _Decoder(torch.nn.Module):
    """A Llama-style decoder stack; the output layer runs on the last token only."""

    def __init__(self, s: ModelShape) -> None:
        super().__init__()
        self.s = s
        self.embed = torch.nn.Embedding(s.vocab, s.hidden)
        self.layers = torch.nn.ModuleList(_Layer(s) for _ in range(s.layers))
        self.norm = torch.nn.RMSNorm(s.hidden, eps=1e-5)
        self.head = torch.nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        out: torch.Tensor = self.head(self.norm(x[:, -1:, :]))
        return out


def _rope_tables(
    n: int, head_dim: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (
        500000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    angles = torch.outer(torch.arange(n, device=device, dtype=torch.float32), inv)
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _build_torch(
    s: ModelShape, device: torch.device, dtype: torch.dtype
) -> Callable[[torch.Tensor], Any]:
    with torch.device(device):
        model = _Decoder(s).to(dtype).eval()
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def run(ids: torch.Tensor) -> Any:
        n = ids.shape[1]
        if n not in tables:
            tables.clear()
            tables[n] = _rope_tables(n, s.head_dim, device, dtype)
        return model(ids, *tables[n])

    return run


def _build_transformers(
    s: ModelShape, device: torch.device, dtype: torch.dtype, longest: int
) -> Callable[[torch.Tensor], Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        s.model_type,
        vocab_size=s.vocab,
        hidden_size=s.hidden,
        intermediate_size=s.intermediate,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        head_dim=s.head_dim,
        max_position_embeddings=max(longest + 1, 4096),
        tie_word_embeddings=s.tie_embeddings,
        use_cache=False,
    )
    config._attn_implementation = "sdpa"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in `dtype` directly: no fp32 copy of 8B weights
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config).eval()  # type: ignore[no-untyped-call]
    finally:
        torch.set_default_dtype(previous)

    def run(ids: torch.Tensor) -> Any:
        return model(input_ids=ids, use_cache=False, logits_to_keep=1).logits

    return run


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_prefill(
    shape: ModelShape,
    lengths: list[int],
    *,
    device: torch.device,
    engine: str = "auto",
    dtype: str = "bfloat16",
    repeats: int = 3,
    warmup: int = 1,
    max_layers: int | None = None,
    log: Callable[[str], None] = print,
) -> PrefillResult:
    """Time a prefill of each length with a random-weight model of `shape` (one rank's
    share for a tensor-parallel shape: pass `shape.rank()`)."""
    if engine not in ENGINES:
        raise ConfigurationError(f"invalid engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if dtype not in DTYPES:
        raise ConfigurationError(f"invalid dtype {dtype!r}: expected one of {', '.join(DTYPES)}")
    if engine == "auto":
        engine = "transformers" if importlib.util.find_spec("transformers") else "torch"
    elif engine == "transformers" and importlib.util.find_spec("transformers") is None:
        raise ConfigurationError(
            "engine 'transformers' asked for, but transformers is not installed"
        )
    tdtype = DTYPES[dtype]
    longest = max(lengths)
    built, why = layers_to_measure(shape, device, tdtype, longest, max_layers)
    sub = shape if built == shape.layers else _with_layers(shape, built)
    torch.manual_seed(0)
    run = (
        _build_transformers(sub, device, tdtype, longest)
        if engine == "transformers"
        else _build_torch(sub, device, tdtype)
    )
    result = PrefillResult(engine, str(device), dtype, shape.layers, built, why)
    scale = shape.layers / built
    gen = torch.Generator(device="cpu").manual_seed(1)
    for n in sorted(lengths):
        ids = torch.randint(0, shape.vocab, (1, n), generator=gen).to(device)
        times: list[float] = []
        try:
            with torch.inference_mode():
                for i in range(warmup + repeats):
                    _sync(device)
                    t0 = time.perf_counter()
                    run(ids)
                    _sync(device)
                    if i >= warmup:
                        times.append(time.perf_counter() - t0)
        except torch.OutOfMemoryError:
            result.stopped = f"out of device memory at {n} tokens"
            log(f"  prefill: {result.stopped}; longer prompts not tried")
            break
        finally:
            del ids
        measured = statistics.median(times)
        seconds = measured * scale
        flops = shape.prefill_flops(n)
        result.points.append(
            {
                "tokens": n,
                "seconds": seconds,
                "measured_seconds": measured,
                "runs": times,
                "flops": flops,
                "achieved_tflops": flops / seconds / 1e12,
            }
        )
        log(
            f"  prefill {n:>7} tokens: {seconds * 1e3:10.2f} ms"
            + (f" (scaled from {built} of {shape.layers} layers)" if scale != 1 else "")
            + f"  {flops / seconds / 1e12:8.2f} TFLOP/s"
        )
    del run
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _with_layers(shape: ModelShape, layers: int) -> ModelShape:
    import dataclasses

    return dataclasses.replace(shape, layers=layers)

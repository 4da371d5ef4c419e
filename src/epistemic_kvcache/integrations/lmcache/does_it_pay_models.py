"""Model shapes for `epistemic-kvcache does-it-pay`: what a prefill computes, what its KV weighs.

No torch here: the shapes, their FLOPs and KV bytes are plain arithmetic, shared by the
command, the prefill measurement and the docs generator (scripts/gen_does_it_pay.py).

- `ModelShape`: a dense decoder-only transformer (Llama, Qwen2, Mistral style: grouped
  query attention, a gated MLP of three matrices). `from_hf_config` reads a Hugging Face
  `config.json`; `BUILTIN` holds common models' published shapes.
- Tensor parallelism: `rank()` is one GPU's share of a model split over `tensor_parallel`
  GPUs (attention heads, KV heads, MLP width and vocabulary divided; KV heads repeated
  when there are fewer than GPUs, as vLLM does). A tensor-parallel model is measured and
  reported per rank: each rank computes its share and fetches its share of the KV.
- `prefill_flops(n)`: FLOPs of an n-token prefill, without the embedding (a table
  lookup) and with the output layer on the last token only (the one whose logits are
  sampled): `2 n x (weights of every layer's matrices) + causal attention
  2 x layers x heads x head_dim x n (n + 1) + 2 x hidden x vocab`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from epistemic_kvcache.errors import ConfigurationError

KV_BYTES_PER_VALUE = 2
"""bf16 / fp16 KV cache (LMCache stores what vLLM computes: 2 bytes a value)."""


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A dense decoder-only transformer's shape; `tensor_parallel` GPUs share it."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    model_type: str = "llama"
    qkv_bias: bool = False
    tie_embeddings: bool = False
    tensor_parallel: int = 1
    source: str = "built-in"

    def __post_init__(self) -> None:
        for field in (
            "layers",
            "hidden",
            "heads",
            "kv_heads",
            "head_dim",
            "intermediate",
            "vocab",
            "tensor_parallel",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigurationError(
                    f"invalid model shape {self.name!r}: {field} must be a positive "
                    f"integer (got {value!r})"
                )
        if self.heads % self.kv_heads:
            raise ConfigurationError(
                f"invalid model shape {self.name!r}: {self.heads} attention heads are not "
                f"a multiple of {self.kv_heads} KV heads"
            )
        tp = self.tensor_parallel
        for field in ("heads", "intermediate", "vocab"):
            if getattr(self, field) % tp:
                raise ConfigurationError(
                    f"invalid tensor_parallel {tp} for {self.name!r}: {field} "
                    f"({getattr(self, field)}) is not a multiple of it"
                )
        if tp > 1 and (self.kv_heads % tp and tp % self.kv_heads):
            raise ConfigurationError(
                f"invalid tensor_parallel {tp} for {self.name!r}: {self.kv_heads} KV heads "
                "neither divide among nor repeat over that many GPUs"
            )

    @property
    def label(self) -> str:
        """The name, with the tensor parallelism said."""
        if self.tensor_parallel == 1:
            return self.name
        return f"{self.name} (tensor-parallel over {self.tensor_parallel} GPUs, per rank)"

    def with_tensor_parallel(self, tp: int) -> ModelShape:
        return dataclasses.replace(self, tensor_parallel=tp)

    def rank(self) -> ModelShape:
        """One GPU's share under tensor parallelism (itself when `tensor_parallel` is 1)."""
        tp = self.tensor_parallel
        if tp == 1:
            return self
        return dataclasses.replace(
            self,
            heads=self.heads // tp,
            kv_heads=max(1, self.kv_heads // tp),
            intermediate=self.intermediate // tp,
            vocab=self.vocab // tp,
            tensor_parallel=1,
            name=f"{self.name} rank 1/{tp}",
        )

    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token adds (K and V, every layer)."""
        return self.layers * 2 * self.kv_heads * self.head_dim * KV_BYTES_PER_VALUE

    def layer_matrix_params(self) -> int:
        """Weights of one layer's matrices (q, k, v, o, gate, up, down)."""
        q_out = self.heads * self.head_dim
        kv_out = 2 * self.kv_heads * self.head_dim
        attn = self.hidden * (q_out + kv_out) + q_out * self.hidden
        return attn + 3 * self.hidden * self.intermediate

    def weight_bytes(self, bytes_per_value: int = 2) -> int:
        """All weights (embedding and output layer twice unless tied; norms ignored)."""
        table = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return (self.layers * self.layer_matrix_params() + table) * bytes_per_value

    def prefill_flops(self, n: int) -> float:
        """FLOPs of an n-token prefill (no embedding; output layer on the last token)."""
        dense = 2.0 * n * self.layers * self.layer_matrix_params()
        attention = 2.0 * self.layers * self.heads * self.head_dim * n * (n + 1)
        return dense + attention + 2.0 * self.hidden * self.vocab

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _llama3(name: str, layers: int, hidden: int, heads: int, inter: int, tp: int) -> ModelShape:
    return ModelShape(
        name,
        layers,
        hidden,
        heads,
        8,
        128,
        inter,
        128256,
        "llama",
        False,
        False,
        tp,
        f"built-in: meta-llama/Meta-{name} config.json",
    )


BUILTIN: dict[str, ModelShape] = {
    "llama-3-8b": _llama3("Llama-3-8B", 32, 4096, 32, 14336, 1),
    # 141 GB of bf16 weights: no single H100/H200 holds it with room for KV; 4 x H100
    # (80 GB) is the smallest common split. --tensor-parallel changes it.
    "llama-3-70b": _llama3("Llama-3-70B", 80, 8192, 64, 28672, 4),
    "qwen2.5-7b": ModelShape(
        "Qwen2.5-7B",
        28,
        3584,
        28,
        4,
        128,
        18944,
        152064,
        "qwen2",
        True,
        False,
        1,
        "built-in: Qwen/Qwen2.5-7B config.json",
    ),
    # The end-to-end tests' model (tests/e2e/tiny_model.py): for CI on a CPU.
    "tiny": ModelShape(
        "tiny",
        2,
        256,
        4,
        2,
        64,
        512,
        2048,
        "llama",
        False,
        False,
        1,
        "built-in: tests/e2e/tiny_model.py",
    ),
}

_UNSUPPORTED = {
    "kv_lora_rank": "multi-head latent attention (DeepSeek MLA)",
    "num_experts": "mixture of experts",
    "num_local_experts": "mixture of experts",
    "n_routed_experts": "mixture of experts",
}


def from_hf_config(path: Path, tensor_parallel: int = 1) -> ModelShape:
    """The shape in a Hugging Face `config.json` (a file, or a folder holding one)."""
    file = path / "config.json" if path.is_dir() else path
    try:
        doc = json.loads(file.read_text())
    except OSError as exc:
        raise ConfigurationError(f"invalid model {str(path)!r}: cannot read it ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ConfigurationError(f"invalid model config {str(file)!r}: not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ConfigurationError(f"invalid model config {str(file)!r}: not a JSON object")
    if isinstance(doc.get("text_config"), dict):  # multimodal wrappers keep the LM here
        doc = {**doc["text_config"], "_name_or_path": doc.get("_name_or_path")}
    for key, what in _UNSUPPORTED.items():
        if doc.get(key):
            raise ConfigurationError(
                f"unsupported model config {str(file)!r}: {key} = {doc[key]!r} ({what}); "
                "does-it-pay measures dense decoder-only models (Llama, Qwen2, Mistral)"
            )

    def need(*names: str) -> int:
        for key in names:
            if key in doc:
                value = doc[key]
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
                raise ConfigurationError(
                    f"invalid model config {str(file)!r}: {key} must be a positive "
                    f"integer (got {value!r})"
                )
        raise ConfigurationError(f"invalid model config {str(file)!r}: no {names[0]}")

    hidden = need("hidden_size", "n_embd")
    heads = need("num_attention_heads", "n_head")
    kv_heads = need("num_key_value_heads") if "num_key_value_heads" in doc else heads
    head_dim = need("head_dim") if doc.get("head_dim") is not None else hidden // heads
    name = str(doc.get("_name_or_path") or "") or (
        file.parent.name if file.name == "config.json" else file.stem
    )
    model_type = str(doc.get("model_type") or "llama")
    return ModelShape(
        name=name,
        layers=need("num_hidden_layers", "n_layer"),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=need("intermediate_size", "n_inner"),
        vocab=need("vocab_size"),
        model_type=model_type,
        qkv_bias=bool(doc.get("attention_bias", model_type == "qwen2")),
        tie_embeddings=bool(doc.get("tie_word_embeddings", False)),
        tensor_parallel=tensor_parallel,
        source=f"config.json: {file}",
    )


def resolve(spec: str, tensor_parallel: int | None = None) -> ModelShape:
    """A built-in name (case-insensitive) or the path of a `config.json` / its folder;
    `tensor_parallel` overrides the built-in default."""
    shape = BUILTIN.get(spec.lower())
    if shape is not None:
        return shape if tensor_parallel is None else shape.with_tensor_parallel(tensor_parallel)
    path = Path(spec)
    if not path.exists():
        raise ConfigurationError(
            f"invalid model {spec!r}: neither a built-in model ({', '.join(BUILTIN)}) nor "
            "a config.json (or folder holding one) that exists"
        )
    return from_hf_config(path, tensor_parallel or 1)

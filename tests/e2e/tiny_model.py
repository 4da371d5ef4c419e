"""Tiny models made on the spot (no weights can be downloaded here).

`make`: Llama-style, 2 layers, hidden size 256, 4 attention heads over 2 KV heads, a
byte-level BPE tokenizer trained with `tokenizers` on the text below, random weights from
a fixed seed saved with `transformers` (vLLM runs them in bfloat16, its CPU default).

`make_hybrid`: Qwen3-Next-shaped (attention plus Gated DeltaNet recurrent layers, the kind
of model the deployment serves): 3 GDN layers and 1 full-attention layer, hidden size 256,
bfloat16, the same tokenizer. vLLM refuses a Qwen3-Next without a mixture-of-experts
layer, so layer 4's MLP is a 4-expert MoE (`decoder_sparse_step=4`). Its GDN layers are
made state-sensitive: with the default weights they forget their state within a few tokens
(zeroed state changes nothing), so `A_log = -6` and `dt_bias = 0` bring the per-token decay
`exp(-exp(A_log) * softplus(a + dt_bias))` close to 1, and the state carried across a
chunk boundary decides the output.

Every process that loads a folder gets the same model, so greedy outputs are comparable
across processes. The prompts (`prompt(name)`) are about 900 tokens each and share no
first chunk.

    python tests/e2e/tiny_model.py OUT_DIR [--hybrid]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

VOCAB_SIZE = 2048
CORPUS = (
    "The cache server keeps the key and value tensors that a language model computed for a "
    "prompt, so that another process which sees the same prompt loads them instead of "
    "computing them again. Loading pays when the bytes arrive faster than the GPU would "
    "recompute them. A tenant sees only its own entries; a restart keeps what was written. "
    "When the server is down the engine recomputes and answers all the same. "
)


# Prompt names and the word each starts at: different first words, so no chunk is shared.
PROMPTS = {"x": 0, "y": 1, "z": 2}


def prompt(name: str = "x", n_words: int = 432) -> str:
    """A deterministic prompt of about 900 tokens with the tokenizer below."""
    words, k = CORPUS.split(), PROMPTS[name]
    return " ".join(f"{words[(i + k) % len(words)]}{(i + k) % 7}" for i in range(n_words))


def make(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    if (out / "done").exists():
        return out
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS, prompt("x", 300)] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        # Weights larger than the default 0.02 so greedy outputs depend on the prompt (at
        # 0.02 every position predicts the same token).
        initializer_range=0.1,
        torch_dtype="float32",
    )
    torch.manual_seed(1234)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    (out / "done").write_text(json.dumps({"tokens": len(fast(prompt())["input_ids"])}))
    return out


def make_hybrid(out: Path, dense: Path) -> Path:
    """The hybrid model in `out`, with the tokenizer of the dense model in `dense`."""
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen3NextConfig, Qwen3NextForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    if (out / "done").exists():
        return out
    fast = PreTrainedTokenizerFast.from_pretrained(dense)
    fast.save_pretrained(out)
    config = Qwen3NextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_conv_kernel_dim=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        decoder_sparse_step=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        max_position_embeddings=2048,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        initializer_range=0.1,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(1234)
    model = Qwen3NextForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".A_log"):
                param.fill_(-6.0)
            elif name.endswith(".dt_bias"):
                param.zero_()
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    (out / "done").write_text(json.dumps({"tokens": len(fast(prompt())["input_ids"])}))
    return out


if __name__ == "__main__":
    dense = make(Path(sys.argv[1]))
    print(make_hybrid(Path(sys.argv[1] + "-hybrid"), dense) if "--hybrid" in sys.argv else dense)

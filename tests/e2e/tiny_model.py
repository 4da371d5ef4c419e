"""A tiny Llama-style model made on the spot (no weights can be downloaded here).

2 layers, hidden size 256, 4 attention heads over 2 KV heads, a byte-level BPE tokenizer
trained with `tokenizers` on the text below, random weights from a fixed seed saved with
`transformers` (vLLM runs them in bfloat16, its CPU default). Every process that loads the
folder gets the same model, so greedy outputs are comparable across processes.

    python tests/e2e/tiny_model.py OUT_DIR
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


def prompt(n_words: int = 432) -> str:
    """A deterministic prompt of about 900 tokens with the tokenizer below."""
    words = CORPUS.split()
    return " ".join(f"{words[i % len(words)]}{i % 7}" for i in range(n_words))


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
    tok.train_from_iterator([CORPUS, prompt(300)] * 4, trainer)
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


if __name__ == "__main__":
    print(make(Path(sys.argv[1])))

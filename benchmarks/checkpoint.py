"""Random Qwen2 checkpoints for benchmarks, built offline with transformers.

The real benchmark uses `omnistage tiny qwen2 DIR --size small`; `ensure_model` prefers that
code (`omnistage.tiny.build_tiny`) and falls back to `build_qwen2` here, which makes a folder
of the same shape (weights, config, byte-level BPE tokenizer) with transformers alone.
"""

from __future__ import annotations

import os
from pathlib import Path

# Shapes of `omnistage tiny qwen2 --size small` (~57M params, fp32, tied embeddings) and a
# toy size for smoke tests.
SIZES = {
    "small": dict(vocab_size=32000, hidden_size=512, num_hidden_layers=12,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                  intermediate_size=1792, max_position_embeddings=4096),
    "toy": dict(vocab_size=1024, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                intermediate_size=128, max_position_embeddings=1024),
}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _train_tokenizer(vocab_size: int):
    """A byte-level BPE trained in well under a second on a fixed, local corpus."""
    import json
    import random as pyrandom

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    rng = pyrandom.Random(0)
    words = (json.__doc__ + pyrandom.__doc__ + os.__doc__).split()
    corpus = [" ".join(rng.choice(words) for _ in range(64)) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    hf_tok = Qwen2Tokenizer(vocab=model["vocab"], merges=merges)
    hf_tok.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    return hf_tok


def build_qwen2(out_dir: str | os.PathLike, size: str = "small", seed: int = 0) -> Path:
    """Write a random fp32 Qwen2ForCausalLM + tokenizer to `out_dir`; return the path."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = SIZES[size]
    out = Path(out_dir)
    tokenizer = _train_tokenizer(min(4000, shape["vocab_size"] - len(SPECIAL_TOKENS)))
    config = Qwen2Config(**shape, tie_word_embeddings=True, rope_theta=10000.0,
                         rms_norm_eps=1e-6, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id, dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(torch.float32).eval()
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def ensure_model(cache_dir: str | os.PathLike | None = None, seed: int = 0) -> Path:
    """Path of the 'small' Qwen2 checkpoint, built once into a cache folder."""
    root = Path(cache_dir or Path.home() / ".cache" / "omnistage" / "bench")
    out = root / f"qwen2-small-seed{seed}"
    if (out / "config.json").exists():
        return out
    try:
        from omnistage.tiny import build_tiny
    except ImportError:
        build_tiny = None
    if build_tiny is not None:
        build_tiny("qwen2", str(out), seed=seed, size="small")
    else:
        build_qwen2(out, "small", seed)
    return out

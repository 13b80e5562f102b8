"""Tiny random Qwen2 (`Qwen2ForCausalLM`) checkpoints in HF format, built offline.

Writes config.json, model.safetensors (or shards + model.safetensors.index.json),
generation_config.json and the tokenizer files (tokenizer.json, tokenizer_config.json with the
ChatML template). Weights are fp32 and random (see `omnistage.tiny.init` for the scales).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

from omnistage.tiny.init import InitScale, reinit_weights_
from omnistage.tiny.spec import TinyArch, TinyBuildOptions, prepare_outdir
from omnistage.tiny.tokenizer import ENDOFTEXT, IM_END, build_qwen_tokenizer
from omnistage.tiny.trained import corpus, tool_chats, train_, train_chats_


@dataclass(frozen=True)
class Qwen2Shape:
    """The HF config fields a size fixes; anything else keeps Qwen2Config's default."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float  # transformers 5 stores it as config.rope_parameters["rope_theta"]
    tie_word_embeddings: bool = True
    rms_norm_eps: float = 1e-6


SIZES: dict[str, Qwen2Shape] = {
    # For tests: ~0.1M parameters; the tokenizer fills all 512 ids.
    "tiny": Qwen2Shape(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        max_position_embeddings=2048,
        rope_theta=10000.0,
    ),
    # For benchmarks: ~57M parameters, shapes of a small real model.
    "small": Qwen2Shape(
        vocab_size=32000,
        hidden_size=512,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1792,
        max_position_embeddings=4096,
        rope_theta=1e6,
    ),
    # For quantization accuracy: ~0.5M parameters, trained for a few seconds (trained.py).
    # "tools" has the same shape, trained on tool-calling chats instead (trained.py).
    "trained": Qwen2Shape(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=384,
        max_position_embeddings=2048,
        rope_theta=10000.0,
    ),
}
SIZES["tools"] = SIZES["trained"]


def make_config(size: str, overrides: dict[str, Any], special_ids: dict[str, int]) -> Qwen2Config:
    fields = asdict(SIZES[size]) | {
        "bos_token_id": special_ids[ENDOFTEXT],  # as real Qwen2.5 configs; the tokenizer adds no bos
        "eos_token_id": special_ids[IM_END],
        "dtype": "float32",
    }
    # Overrides go in at construction: derived fields (layer_types, rope_parameters) follow them.
    return Qwen2Config(**(fields | dict(overrides)))


def build(options: TinyBuildOptions) -> None:
    vocab_size = int(options.overrides.get("vocab_size", SIZES[options.size].vocab_size))
    max_len = int(options.overrides.get("max_position_embeddings", SIZES[options.size].max_position_embeddings))
    tokenizer = build_qwen_tokenizer(vocab_size, model_max_length=max_len)
    special_ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok in (ENDOFTEXT, IM_END)}
    config = make_config(options.size, dict(options.overrides), special_ids)

    # fork_rng: seeding must not disturb the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(options.seed)
        model = Qwen2ForCausalLM(config).eval()
        if options.size == "trained":
            text = corpus(options.seed, sentences=4000)
            train_(model, tokenizer.encode(text, verbose=False), options.seed)
        elif options.size == "tools":
            chats = tool_chats(tokenizer, options.seed, count=200)
            train_chats_(model, [tokenizer.encode(c, verbose=False) for c in chats], options.seed)
    if options.size not in ("trained", "tools"):
        reinit_weights_(model, options.seed, InitScale())
    model.generation_config = GenerationConfig(
        bos_token_id=special_ids[ENDOFTEXT],
        eos_token_id=[special_ids[IM_END], special_ids[ENDOFTEXT]],
        pad_token_id=special_ids[ENDOFTEXT],
    )

    prepare_outdir(options.outdir)
    model.save_pretrained(options.outdir, max_shard_size=options.max_shard_size)
    # save_jinja_files=False keeps the template inside tokenizer_config.json, as Qwen repos do
    # (transformers 5 would otherwise write a separate chat_template.jinja).
    tokenizer.save_pretrained(options.outdir, save_jinja_files=False)


QWEN2 = TinyArch(name="qwen2", sizes=tuple(SIZES), build=build)

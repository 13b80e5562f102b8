"""A Qwen2 HF folder (the benchmark checkpoints, the tests' tiny ones) as a GGUF file: float32
for llama.cpp (which quantizes it with its own tool), or q8_0 / q4_0 written here with gguf-py's
reference quantizers (the tests' pre-quantized checkpoints).

llama.cpp's own convert_hf_to_gguf.py refuses our tokenizer: it recognises a BPE
pre-tokenizer by hashing its output on a fixed text against a list of published models, and
our offline byte-level BPE is on none of them. The weights and hyperparameters are all the
benchmark needs (it feeds token ids), so this writes them with llama.cpp's own gguf-py
library (from the same sdist, passed in as `gguf`), the tokenizer's vocabulary and merges as
a GPT-2-style BPE with Qwen2's pre-tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import torch

from omnistage.layers.gguf import LAYER_NAMES

# HF Qwen2 tensor name parts -> GGUF's (llama.cpp's tensor naming): the reader's map, inverted
_LAYER_NAMES = {hf: name for name, hf in LAYER_NAMES.items()}


def gguf_name(hf_name: str) -> str | None:
    """The GGUF tensor name of an HF Qwen2 tensor (None: not stored, e.g. a tied lm_head)."""
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"]:
        return f"blk.{parts[2]}.{_LAYER_NAMES['.'.join(parts[3:])]}"
    raise ValueError(f"no GGUF name for tensor {hf_name!r}")


# file type -> (gguf's LlamaFileType member, the quantization type of 2-D weights)
FILE_TYPES = {"f32": ("ALL_F32", "F32"), "q8_0": ("MOSTLY_Q8_0", "Q8_0"),
              "q4_0": ("MOSTLY_Q4_0", "Q4_0"), "q4_1": ("MOSTLY_Q4_1", "Q4_1")}


def export(model_dir: Path, out: Path, gguf: ModuleType, file_type: str = "f32") -> Path:
    """Write `model_dir` (a Qwen2 HF folder, float weights) to `out` as GGUF, its matrices
    (the embedding table included) in `file_type`, the rest float32."""
    from safetensors.torch import load_file

    cfg = json.loads((model_dir / "config.json").read_text())
    if cfg.get("model_type") != "qwen2":
        raise ValueError(f"{model_dir}: model_type {cfg.get('model_type')!r}, this writes qwen2 only")
    ftype, qtype = FILE_TYPES[file_type]
    qtype = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(str(out), "qwen2")
    w.add_name(model_dir.name)
    w.add_file_type(gguf.LlamaFileType[ftype])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    _add_tokenizer(w, model_dir, cfg, gguf)
    tied = cfg.get("tie_word_embeddings", False)
    for file in sorted(model_dir.glob("*.safetensors")):
        for name, t in load_file(file).items():
            if tied and name == "lm_head.weight":
                continue
            values = t.to(torch.float32).numpy()
            if t.dim() == 2 and qtype != gguf.GGMLQuantizationType.F32:
                w.add_tensor(gguf_name(name), gguf.quants.quantize(values, qtype), raw_dtype=qtype)
            else:
                w.add_tensor(gguf_name(name), values)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def _add_tokenizer(w, model_dir: Path, cfg: dict, gguf: ModuleType) -> None:
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    vocab.update(special)
    size = cfg["vocab_size"]
    by_id = {i: s for s, i in vocab.items()}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    types = [gguf.TokenType.CONTROL if t in special else
             gguf.TokenType.NORMAL if i in by_id else gguf.TokenType.UNUSED
             for i, t in enumerate(tokens)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg.get("bos_token_id") or 0)
    w.add_eos_token_id(cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], int) else cfg["eos_token_id"][0])
    template = json.loads((model_dir / "tokenizer_config.json").read_text()).get("chat_template")
    if template:
        w.add_chat_template(template)

"""A built checkpoint's weights stored as released models store theirs: bfloat16.

The builders write float32 (tests compare engines over the same weights, whatever their
dtype). Qwen2.5-Omni, Qwen3-Omni and the diffusion families are released as bfloat16
safetensors, and an engine may keep such weights narrow (omnistage does, exactly:
docs/quantization.md), so benchmarks can ask for a folder stored the released way."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS_DTYPES = ("float32", "bfloat16")


def store_as_bfloat16(folder: Path) -> None:
    """Rewrite every safetensors file under `folder` with its floating tensors in bfloat16
    (rounded to nearest), each shard index's total size to match, and the top-level
    config.json's dtype fields (transformers' `dtype` / `torch_dtype`) to bfloat16."""
    sizes: dict[Path, int] = {}
    for f in sorted(folder.rglob("*.safetensors")):
        tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
                   for k, v in load_file(f).items()}
        save_file(tensors, f, metadata={"format": "pt"})
        sizes[f] = sum(t.numel() * t.element_size() for t in tensors.values())
    for index in folder.rglob("*.safetensors.index.json"):
        meta = json.loads(index.read_text())
        shards = {index.parent / name for name in meta.get("weight_map", {}).values()}
        meta.setdefault("metadata", {})["total_size"] = sum(sizes.get(f, 0) for f in shards)
        index.write_text(json.dumps(meta, indent=2))
    config = folder / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        keys = [key for key in ("dtype", "torch_dtype") if key in cfg] or ["dtype"]
        config.write_text(json.dumps({**cfg, **{key: "bfloat16" for key in keys}}, indent=2))

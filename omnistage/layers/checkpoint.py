"""Reading an HF-format model folder: config.json (or a diffusers folder's model_index.json),
its safetensors files (memory-mapped, tensor by tensor), its tokenizer and EOS ids. A GGUF
file stands for such a folder too (layers/gguf.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from omnistage.errors import CheckpointError, ModelLoadError, ModelNotFoundError
from omnistage.layers.gguf import gguf_config, is_gguf, load_gguf_tokenizer


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir)
    if is_gguf(path):
        return gguf_config(path)
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model path {str(model_dir)!r} is not a folder or a .gguf file; pass a local "
            f"HF-format folder (config.json + *.safetensors), e.g. one built by `omnistage tiny "
            f"qwen2 DIR`, or a GGUF file")
    cfg_file = path / "config.json"
    if not cfg_file.is_file() and (path / "model_index.json").is_file():
        # a diffusers folder: its pipeline class stands for the architecture
        return {"architectures": [read_model_index(path)["_class_name"]]}
    if not cfg_file.is_file():
        raise ModelNotFoundError(f"{cfg_file} is missing; the model folder needs an HF config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON ({e}); fix or regenerate it") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_file} must hold a JSON object")
    return cfg


def architecture_of(cfg: dict) -> str:
    archs = cfg.get("architectures") or []
    if not archs:
        raise ModelLoadError("config.json has no 'architectures' entry; add e.g. [\"Qwen2ForCausalLM\"]")
    return archs[0]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e})") from e
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(
                f"no weights in {model_dir}: expected model.safetensors or "
                f"model.safetensors.index.json (only safetensors checkpoints are loaded)")
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"weight files listed by the index are missing in {model_dir}: {missing}")
    return files


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{f} is not a readable safetensors file ({e}); "
                                  f"re-create or re-download it") from e


def read_model_index(folder: str | Path) -> dict:
    path = Path(folder) / "model_index.json"
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ModelLoadError(f"{path} is missing; a diffusers folder needs model_index.json") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(index, dict) or "_class_name" not in index:
        raise ModelLoadError(f"{path} must be an object with a '_class_name'")
    return index


def load_tokenizer(path: str, config=None):
    """The folder's tokenizer. `config`: the model config transformers would otherwise build
    from config.json just to read the model type (a composite model's full config can be
    costly or noisy to build; the tokenizer class still comes from tokenizer_config.json)."""
    from transformers import AutoTokenizer

    if is_gguf(path):
        return load_gguf_tokenizer(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **({"config": config} if config is not None else {}))
    except (OSError, ValueError, TypeError) as e:
        raise ModelLoadError(f"cannot load a tokenizer from {path} ({e}); the folder needs "
                             f"tokenizer.json / tokenizer_config.json") from e
    if len(tokenizer) < 2:  # transformers builds an empty one when the files are missing
        raise ModelLoadError(f"no tokenizer vocabulary in {path}; the folder needs "
                             f"tokenizer.json / tokenizer_config.json (or pass tokenizer=FOLDER)")
    return tokenizer


def eos_token_ids(model_dir: str, tokenizer) -> set[int]:
    """EOS ids from generation_config.json (int or list) plus the tokenizer's own."""
    ids: set[int] = set()
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{gen} is not valid JSON ({e})") from e
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids |= {int(x) for x in eos}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids

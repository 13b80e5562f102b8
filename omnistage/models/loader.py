"""Load an HF-format folder: config.json + model.safetensors (or a sharded index).

Parameters are created on the meta device, materialised once on the target device, and filled
tensor by tensor from memory-mapped safetensors files, so peak memory is about one copy of
the weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from omnistage.errors import CheckpointError, ModelLoadError, ModelNotFoundError
from omnistage.models import resolve_model_class

log = logging.getLogger(__name__)


def read_config(model_dir: str | Path) -> dict:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model path {str(model_dir)!r} is not a folder; pass a local HF-format folder "
            f"(config.json + *.safetensors), e.g. one built by `omnistage tiny qwen2 DIR`")
    cfg_file = path / "config.json"
    if not cfg_file.is_file() and (path / "model_index.json").is_file():
        # a diffusers folder: its pipeline class stands for the architecture
        from omnistage.diffusion.components import read_model_index

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


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Build the model named by config.json and fill it from the folder's safetensors."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    cls = resolve_model_class(architecture_of(cfg))
    try:
        config = cls.config_class.from_hf(cfg)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{model_dir / 'config.json'}: cannot use it ({e!r})") from e
    model = cls(config, dtype=dtype, device=device)
    model.to_empty(device=device)
    fill_model(model, iter_weights(safetensors_files(model_dir)), str(model_dir), warn_unused=True)
    return model.eval()


def fill_model(model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]], where: str,
               warn_unused: bool = False) -> None:
    """Feed checkpoint tensors to an engine model's load_weights; check it got all it needs.
    Tensors the model does not use (KeyError) are skipped: logged when `warn_unused`."""
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in weights:
            try:
                loaded |= model.load_weights([(name, tensor)])
            except KeyError:
                if warn_unused:
                    log.warning("ignoring checkpoint tensor %s (not used by %s)", name,
                                type(model).__name__)
            except ValueError as e:
                raise CheckpointError(f"checkpoint tensor {name}: {e}") from e
    missing = model.expected_loads() - loaded
    if missing:
        raise CheckpointError(f"{where} lacks weights for {len(missing)} parameters of "
                              f"{type(model).__name__}, e.g. {sorted(missing)[:5]}; the checkpoint "
                              f"is incomplete")

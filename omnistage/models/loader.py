"""Load an HF-format folder served by the AR engine: config.json + model.safetensors (or a
sharded index), through the table of architectures in `omnistage.models`; or a GGUF file
(layers/gguf.py), whose q4_0 / q8_0 weights stay as stored where the native kernel serves.

Parameters are created on the meta device, materialised once on the target device, and filled
tensor by tensor from memory-mapped safetensors files, so peak memory is about one copy of
the weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.config import EngineConfig
from omnistage.errors import ModelLoadError
from omnistage.layers.checkpoint import (architecture_of, eos_token_ids, iter_weights,
                                         load_tokenizer, read_config, safetensors_files)
from omnistage.layers.gguf import gguf_weights, is_gguf
from omnistage.layers.linear import native_kernel_for
from omnistage.layers.weights import fill_model, materialize
from omnistage.models import resolve_model_class


def load_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device,
               pack_for: EngineConfig | None = None) -> torch.nn.Module:
    """Build the model named by config.json and fill it from the folder's safetensors
    (`pack_for`: packing its linear layers for that config's weight format as they load)."""
    model_dir = Path(model_dir)
    cfg = read_config(model_dir)
    cls = resolve_model_class(architecture_of(cfg))
    gguf = is_gguf(model_dir)
    try:
        config = cls.config_class.from_hf(cfg)
    except (KeyError, TypeError, ValueError) as e:
        where = model_dir if gguf else model_dir / "config.json"
        raise ModelLoadError(f"{where}: cannot use it ({e!r})") from e
    model = cls(config, dtype=dtype, device=device)
    materialize(model, device)
    if gguf:
        weights = gguf_weights(model_dir, keep_codes=keeps_codes(pack_for, device, dtype))
    else:
        weights = iter_weights(safetensors_files(model_dir))
    fill_model(model, weights, str(model_dir), warn_unused=True, pack_for=pack_for)
    return model.eval()


def keeps_codes(config: EngineConfig | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a GGUF file's quantized weights stay as stored: the native linear kernel serves
    here and no `quantization` asks for another format."""
    if config is None or config.quantization != "none" or config.linear_kernel not in ("auto", "native"):
        return False
    return native_kernel_for(config, device, dtype)[0] is not None


def load_text_model(config: EngineConfig) -> tuple[torch.nn.Module, object, set[int]]:
    """(model, tokenizer, EOS ids) of the text model `config.model`, in the config's dtype
    (`auto`: the checkpoint's) on its device: what an LLMEngine serves."""
    hf_config = read_config(config.model)
    dtype = config.torch_dtype(hf_config.get("dtype") or hf_config.get("torch_dtype"))
    model = load_model(config.model, dtype, config.torch_device, pack_for=config)
    tokenizer = load_tokenizer(config.tokenizer or config.model)
    return model, tokenizer, eos_token_ids(config.model, tokenizer)

"""Loading a diffusers-format folder's components (model_index.json + one subfolder each).

model_index.json names, per component, a library and a class: ["diffusers",
"QwenImageTransformer2DModel"]. Only classes of diffusers and transformers are loaded (a
folder cannot make us import anything else), each with its own `from_pretrained`.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from omnistage.errors import CheckpointError, ModelLoadError
from omnistage.layers.checkpoint import read_model_index

_LIBRARIES = ("diffusers", "transformers")
_NO_DTYPE = ("scheduler", "tokenizer", "processor", "feature_extractor", "image_processor")


def load_component(folder: str | Path, name: str, dtype: torch.dtype, device: torch.device,
                   index: dict | None = None) -> Any:
    """The component `name` of the folder (None when model_index.json lists it as null).

    On the "meta" device, models are built from their configs without reading any weights:
    a process that only checks requests (its stage runs elsewhere) needs the configs alone."""
    index = index if index is not None else read_model_index(folder)
    spec = index.get(name)
    if spec is None or spec == [None, None]:
        return None
    if not (isinstance(spec, list) and len(spec) == 2 and spec[0] in _LIBRARIES):
        raise ModelLoadError(f"model_index.json: component {name!r} must be [library, class] with "
                             f"library one of {_LIBRARIES}, got {spec!r}")
    library, cls_name = spec
    cls = getattr(importlib.import_module(library), cls_name, None)
    if cls is None:
        raise ModelLoadError(f"model_index.json: {library} has no class {cls_name!r} (component {name!r}); "
                             f"the installed {library} may be too old")
    sub = Path(folder) / name
    if not sub.is_dir():
        raise CheckpointError(f"{sub} is missing (model_index.json lists component {name!r})")
    try:
        if name in _NO_DTYPE or cls_name.endswith(("Tokenizer", "TokenizerFast", "Processor", "Scheduler")):
            return cls.from_pretrained(sub)
        if device.type == "meta":
            return _config_only(cls, library, sub, dtype)
        kw = {"dtype": dtype} if library == "transformers" else {"torch_dtype": dtype}
        model = cls.from_pretrained(sub, **kw)
    except (OSError, ValueError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"cannot load component {name!r} from {sub}: {e}") from e
    return model.to(device).eval()


COMMON = ("transformer", "vae", "text_encoder", "tokenizer", "scheduler")


def load_components(owner: Any, folder: str | Path, device: torch.device, dtype: torch.dtype,
                    names: tuple[str, ...] = COMMON) -> dict:
    """Load each named component onto `owner` as an attribute of the same name (None where
    model_index.json lists it as null); sets owner.device / owner.dtype; returns the index."""
    index = read_model_index(folder)
    owner.device, owner.dtype = device, dtype
    for name in names:
        setattr(owner, name, load_component(folder, name, dtype, device, index))
    return index


def _config_only(cls, library: str, sub: Path, dtype: torch.dtype):
    """The model class instantiated from its config on the meta device (no weights, no memory)."""
    with torch.device("meta"):
        if library == "diffusers":
            model = cls.from_config(cls.load_config(sub))
        else:
            from transformers import AutoConfig

            model = cls._from_config(AutoConfig.from_pretrained(sub), dtype=dtype)
    return model.eval()

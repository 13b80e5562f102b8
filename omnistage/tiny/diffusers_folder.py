"""What every tiny diffusers-format builder shares: seeding, saving components, model_index.json.

A diffusers folder is `model_index.json` (the pipeline class, each component's [library, class],
extra pipeline config such as Wan2.2's `boundary_ratio`) plus one subfolder per component,
written by that component's own `save_pretrained`, so `Pipeline.from_pretrained(folder)` loads
it exactly as it loads a real checkpoint.

Determinism: each component is built inside `seeded(...)` with its own seed derived from the
build seed (`component_seed`), so adding or resizing one component never changes another's
weights, and the caller's global RNG state is left untouched.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffusers
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase, ProcessorMixin

logger = logging.getLogger(__name__)

MODEL_INDEX = "model_index.json"
# Libraries a component class may come from, as model_index.json names them.
_LIBRARIES = ("diffusers", "transformers")


@dataclass(frozen=True)
class PipelineFolder:
    """One diffusers folder to write.

    `components` maps a subfolder name to an object with `save_pretrained` (a model, tokenizer,
    processor or scheduler) or to None for an optional component the pipeline loads as absent
    (written as [null, null], like Wan2.2-I2V's image encoder). `config` holds the pipeline's
    own registered config (e.g. {"boundary_ratio": 0.875}).
    """

    pipeline_class: str
    components: Mapping[str, Any]
    config: Mapping[str, Any] = field(default_factory=dict)


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Seed torch's global CPU RNG for the block (module constructors draw from it), then restore it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def component_seed(seed: int, index: int) -> int:
    """A distinct seed per (build seed, component index); index < 16."""
    if not 0 <= index < 16:
        raise ValueError(f"component index must be in [0, 16), got {index}")
    return 16 * seed + index


def deep_merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`base` with `overrides` merged in; nested mappings are merged key by key, not replaced."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def count_parameters(module: nn.Module) -> int:
    """Unique parameters (shared/tied ones once); `parameters()` already deduplicates."""
    return sum(p.numel() for p in module.parameters())


def parameter_counts(components: Mapping[str, Any]) -> dict[str, int]:
    """Parameters of each model component (tokenizers, schedulers and absent ones left out)."""
    return {name: count_parameters(c) for name, c in components.items() if isinstance(c, nn.Module)}


def library_and_class(component: Any) -> tuple[str, str]:
    """("diffusers" | "transformers", class name), as model_index.json records a component."""
    library = type(component).__module__.split(".")[0]
    if library not in _LIBRARIES:
        raise TypeError(f"{type(component).__name__} is from {library!r}; expected one of {_LIBRARIES}")
    return library, type(component).__name__


def model_index(folder: PipelineFolder) -> dict[str, Any]:
    """The content of model_index.json for `folder`."""
    index: dict[str, Any] = {"_class_name": folder.pipeline_class, "_diffusers_version": diffusers.__version__}
    index.update(folder.config)
    for name, component in folder.components.items():
        index[name] = [None, None] if component is None else list(library_and_class(component))
    return index


def _clear_previous(outdir: Path, names: list[str]) -> None:
    """Remove model_index.json and the component subfolders of a previous build (and `names`),
    so a rebuild never mixes old shards or components with new ones."""
    old_index = outdir / MODEL_INDEX
    stale = set(names)
    if old_index.exists():
        previous = json.loads(old_index.read_text(encoding="utf-8"))
        stale |= {key for key, value in previous.items() if not key.startswith("_") and isinstance(value, list)}
        old_index.unlink()
    for name in sorted(stale):
        path = outdir / name
        if path.is_dir() and path.resolve().parent == outdir.resolve():  # only direct subfolders
            shutil.rmtree(path)


def save_component(component: Any, path: Path, max_shard_size: int | str) -> None:
    """Write one component into `path` with its own `save_pretrained`."""
    if isinstance(component, nn.Module):  # diffusers ModelMixin or transformers PreTrainedModel
        component.save_pretrained(path, max_shard_size=max_shard_size)
    elif isinstance(component, ProcessorMixin):
        # The hub layout: the parts' own files side by side (preprocessor_config.json, tokenizer
        # files), which the processor and each part's class load alike.
        for attribute in component.get_attributes():
            save_component(getattr(component, attribute), path, max_shard_size)
    elif isinstance(component, PreTrainedTokenizerBase):
        # Keep a chat template inside tokenizer_config.json, as the Qwen repos do.
        component.save_pretrained(path, save_jinja_files=False)
    else:
        component.save_pretrained(path)


def write_pipeline_folder(folder: PipelineFolder, outdir: Path, max_shard_size: int | str) -> None:
    """Write every component's subfolder and model_index.json into `outdir` (created if missing)."""
    outdir.mkdir(parents=True, exist_ok=True)
    _clear_previous(outdir, list(folder.components))
    for name, component in folder.components.items():
        if component is not None:
            save_component(component, outdir / name, max_shard_size)
    counts = ", ".join(f"{name} {n / 1e6:.2f}M" for name, n in parameter_counts(folder.components).items())
    logger.info("wrote %s to %s: %s", folder.pipeline_class, outdir, counts)
    # Written last: a folder with a model_index.json is complete.
    text = json.dumps(model_index(folder), indent=2, sort_keys=True) + "\n"
    (outdir / MODEL_INDEX).write_text(text, encoding="utf-8")

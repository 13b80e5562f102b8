"""Where a model name points: a local folder, or `tiny:ARCH` built offline into a cache dir."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from omnistage.models.cascade.spec import PREFIX, cascade_folder
from omnistage.paths import build_lock, cache_dir


def resolve_model(model: str) -> str:
    """`tiny:ARCH[:size]` -> a tiny random checkpoint built on first use (seed 0);
    `cascade:ASR+LLM+TTS` -> the cascade's folder (models/cascade/spec.py)."""
    if model.startswith(PREFIX):
        return str(cascade_folder(model, resolve_model))
    if not model.startswith("tiny:"):
        return model
    parts = model.split(":")
    arch, size = parts[1], (parts[2] if len(parts) > 2 else "tiny")
    if not (arch.isidentifier() and size.isidentifier()):
        from omnistage.errors import InvalidRequestError

        raise InvalidRequestError(f"{model!r} is not tiny:ARCH[:SIZE] (letters, digits, _)", param="model")
    return str(tiny_checkpoint(arch, size))


def tiny_checkpoint(arch: str, size: str = "tiny", seed: int = 0, weights_dtype: str = "float32") -> Path:
    """The cached folder of a tiny random checkpoint, built there on first use (weights in
    `weights_dtype`: build_tiny)."""
    out = cache_dir() / "tiny" / f"{arch}-{size}-seed{seed}{'-bf16' if weights_dtype == 'bfloat16' else ''}"
    if _built(out):
        return out
    with build_lock(out):
        if not _built(out):
            _build(arch, size, seed, weights_dtype, out)
    return out


def _build(arch: str, size: str, seed: int, weights_dtype: str, out: Path) -> None:
    # Imported only to build: the builders import transformers' modeling code (seconds).
    from omnistage.tiny import build_tiny

    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    build_tiny(arch, tmp, seed=seed, size=size, weights_dtype=weights_dtype)
    try:
        tmp.rename(out)  # atomic: a half-built folder is never picked up
    except OSError:
        if not _built(out):
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # built meanwhile where flock is absent


def _built(folder: Path) -> bool:
    """An HF model folder (config.json) or a diffusers one (model_index.json)."""
    return (folder / "config.json").is_file() or (folder / "model_index.json").is_file()

"""What a tiny-checkpoint builder receives, how an architecture registers itself, and the
folder preparation every builder shares."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Default `save_pretrained` shard size: checkpoints above it are sharded with an index file.
DEFAULT_MAX_SHARD_SIZE = "100MB"


@dataclass(frozen=True)
class TinyBuildOptions:
    outdir: Path  # folder to write (created if missing)
    seed: int = 0  # weights are a pure function of (arch, size, overrides, seed)
    size: str = "tiny"  # one of the arch's `sizes`
    overrides: Mapping[str, Any] = field(default_factory=dict)  # HF config fields to replace
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE  # as in `save_pretrained`


@dataclass(frozen=True)
class TinyArch:
    """One buildable architecture: its size names and a function that writes the folder."""

    name: str
    sizes: tuple[str, ...]
    build: Callable[[TinyBuildOptions], None]


def prepare_outdir(outdir: Path) -> None:
    """Create `outdir` and remove weight files a previous build may have left there.

    Without this, rebuilding unsharded over a sharded build leaves a stale
    model.safetensors.index.json (and shards) next to the new model.safetensors.
    """
    outdir.mkdir(parents=True, exist_ok=True)
    stale = [
        *outdir.glob("model-*-of-*.safetensors"),
        outdir / "model.safetensors",
        outdir / "model.safetensors.index.json",
    ]
    for path in stale:
        path.unlink(missing_ok=True)

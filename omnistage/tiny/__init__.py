"""Tiny random HF-format checkpoints, built offline, for tests and benchmarks.

Adding an architecture: write `omnistage/tiny/<arch>.py` with a `build(TinyBuildOptions)`
function and a `TinyArch`, and list it in `TINY_ARCHS` below.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from omnistage.errors import InvalidRequestError
from omnistage.tiny.longcat_image import LONGCAT_IMAGE, LONGCAT_IMAGE_EDIT
from omnistage.tiny.ovis_image import OVIS_IMAGE
from omnistage.tiny.qwen2 import QWEN2
from omnistage.tiny.qwen2_5_omni import QWEN2_5_OMNI
from omnistage.tiny.qwen3_omni import QWEN3_OMNI
from omnistage.tiny.qwen_image import QWEN_IMAGE, QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS, QWEN_IMAGE_LAYERED
from omnistage.tiny.spec import DEFAULT_MAX_SHARD_SIZE, TinyArch, TinyBuildOptions
from omnistage.tiny.storage import WEIGHTS_DTYPES, store_as_bfloat16
from omnistage.tiny.wan import WAN, WAN_I2V
from omnistage.tiny.z_image import Z_IMAGE

TINY_ARCHS: Mapping[str, TinyArch] = {
    arch.name: arch
    for arch in (
        QWEN2,
        QWEN2_5_OMNI,
        QWEN3_OMNI,
        QWEN_IMAGE,
        QWEN_IMAGE_EDIT,
        QWEN_IMAGE_EDIT_PLUS,
        QWEN_IMAGE_LAYERED,
        Z_IMAGE,
        WAN,
        WAN_I2V,
        OVIS_IMAGE,
        LONGCAT_IMAGE,
        LONGCAT_IMAGE_EDIT,
    )
}
SUPPORTED_TINY_ARCHS: tuple[str, ...] = tuple(TINY_ARCHS)


def build_tiny(
    arch: str,
    outdir: str | Path,
    seed: int = 0,
    size: str = "tiny",
    overrides: Mapping[str, Any] | None = None,
    *,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    weights_dtype: str = "float32",
) -> Path:
    """Write a random `arch` checkpoint of `size` into `outdir`; return the folder's path.

    The same (arch, size, overrides, seed) always writes identical files. `overrides` replaces
    HF config fields (e.g. {"num_hidden_layers": 3}); `max_shard_size` is passed to
    `save_pretrained` (checkpoints above it are sharded with an index file); `weights_dtype`
    bfloat16 stores the weights as released models do (storage.py).
    """
    if weights_dtype not in WEIGHTS_DTYPES:
        raise InvalidRequestError(f"weights_dtype must be one of {', '.join(WEIGHTS_DTYPES)}; "
                                  f"got {weights_dtype!r}", param="weights_dtype")
    if arch not in TINY_ARCHS:
        raise InvalidRequestError(
            f"unknown tiny architecture {arch!r}; choose one of: {', '.join(SUPPORTED_TINY_ARCHS)}",
            param="arch",
        )
    spec = TINY_ARCHS[arch]
    if size not in spec.sizes:
        raise InvalidRequestError(
            f"unknown size {size!r} for {arch!r}; choose one of: {', '.join(spec.sizes)}", param="size"
        )
    path = Path(outdir)
    spec.build(
        TinyBuildOptions(
            outdir=path, seed=seed, size=size, overrides=dict(overrides or {}), max_shard_size=max_shard_size
        )
    )
    if weights_dtype == "bfloat16":
        store_as_bfloat16(path)
    return path


__all__ = ["SUPPORTED_TINY_ARCHS", "TINY_ARCHS", "TinyArch", "TinyBuildOptions", "build_tiny"]

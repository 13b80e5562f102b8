"""Fill a plain `nn.Module` (encoders, vocoders: anything not served by the AR engine) from
checkpoint tensors whose names match the module's own state-dict names after a prefix."""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from omnistage.errors import CheckpointError


def load_prefixed(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                  prefix: str) -> set[str]:
    """Copy every tensor named `prefix + key` into `module`'s state entry `key`.

    Tensors without the prefix are skipped; a prefixed name the module lacks, or a shape
    mismatch, raises CheckpointError. Returns the state keys that were filled.
    """
    state = module.state_dict(keep_vars=True)
    loaded: set[str] = set()
    with torch.no_grad():
        for name, w in weights:
            if not name.startswith(prefix):
                continue
            key = name[len(prefix):]
            if key not in state:
                raise CheckpointError(f"checkpoint tensor {name} has no place in {type(module).__name__}")
            dst = state[key]
            if dst.shape != w.shape:
                raise CheckpointError(f"checkpoint tensor {name}: shape {tuple(w.shape)} does not "
                                      f"match the config's {tuple(dst.shape)}")
            dst.copy_(w)
            loaded.add(key)
    return loaded


def require_complete(module: nn.Module, loaded: set[str], where: str) -> None:
    """Raise CheckpointError naming the parameters/buffers `loaded` did not fill.

    Non-persistent buffers are not in the state dict and are never required.
    """
    missing = set(module.state_dict()) - loaded
    if missing:
        raise CheckpointError(f"{where} lacks weights for {len(missing)} tensors, "
                              f"e.g. {sorted(missing)[:5]}; the checkpoint is incomplete")

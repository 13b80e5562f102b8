"""Fill modules from checkpoint tensors: an engine model through its `load_weights` name map
(`fill_model`), or a plain `nn.Module` (encoders, vocoders) whose state-dict names match the
checkpoint's after a prefix (`load_prefixed`); modules built on the meta device get their
tensors first (`materialize`)."""

from __future__ import annotations

import logging
from typing import Iterable, Iterator

import torch
from torch import nn

from omnistage.config import EngineConfig
from omnistage.errors import CheckpointError
from omnistage.layers.linear import pack_while_loading

log = logging.getLogger(__name__)


def materialize(module: nn.Module, device: torch.device | str) -> nn.Module:
    """`module.to_empty(device=device)`: every parameter and buffer (built on the meta device)
    replaced by an uninitialised tensor of its shape and dtype on `device`, in place; returns
    `module`. Not to_empty itself: its `empty_like` of a meta tensor runs torch's Python
    reference, whose first call imports sympy (~1 s of every server start and CLI run). As
    to_empty, a parameter shared by two modules becomes two tensors (loading fills each)."""
    for mod in module.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            empty = torch.empty(p.shape, dtype=p.dtype, device=device)
            setattr(mod, name, nn.Parameter(empty, requires_grad=p.requires_grad))
        for name, b in list(mod.named_buffers(recurse=False)):
            setattr(mod, name, torch.empty(b.shape, dtype=b.dtype, device=device))  # stays a buffer
    return module


def meta_embedding(num: int, dim: int, dtype: torch.dtype | None = None) -> nn.Embedding:
    """An nn.Embedding on the meta device without its init: nn.Embedding's normal_ on a meta
    tensor runs torch's Python reference, which imports torch._dynamo (~2 s of a start)."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim, dtype=dtype, device="meta"))


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


def fill_model(model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]], where: str,
               warn_unused: bool = False, pack_for: EngineConfig | None = None) -> None:
    """Feed checkpoint tensors to an engine model's load_weights; check it got all it needs.
    Tensors the model does not use (KeyError) are skipped: logged when `warn_unused`.
    `pack_for`: its linear layers pack for that config's weight format as they load
    (linear.pack_while_loading)."""
    if pack_for is not None:
        pack_while_loading(model, pack_for)
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

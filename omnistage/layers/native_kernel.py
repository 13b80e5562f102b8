"""Handing one compiled kernel to every module of a kind (SnakeBeta, code2wav's residual units):
built once, where it builds; modules whose inputs it does not take keep their torch ops."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from omnistage.kernels.build import NativeBuildError

log = logging.getLogger(__name__)


def attach_kernel(model: nn.Module, kind: type[nn.Module], build: Callable[[], object], what: str) -> int:
    """`build()` set as the `kernel` of every `kind` module of `model`. -> how many took it (0:
    none there, or the kernel did not build: logged, `what` naming the modules)."""
    modules = [m for m in model.modules() if isinstance(m, kind)]
    if not modules:
        return 0
    try:
        kernel = build()
    except NativeBuildError as e:
        log.info("%s stay on torch ops: %s", what, e)
        return 0
    for m in modules:
        m.kernel = kernel
    return len(modules)


@dataclass(frozen=True, eq=False)
class ParameterState:
    """What a module's kernel-ready tensors were derived from, to derive them again only after
    a parameter changed: modified in place (a load's copy_: the version), replaced (another
    object) or given other data (`.data =`, as `module.to` does: another storage). Each
    parameter's data then is kept, so its storage is not freed and its address never reused
    by a later one."""
    entries: tuple[tuple[torch.Tensor, torch.Tensor, int], ...]

    @classmethod
    def of(cls, params: Iterable[torch.Tensor]) -> "ParameterState":
        return cls(tuple((p, p.data, p._version) for p in params))

    def matches(self, params: Iterable[torch.Tensor]) -> bool:
        params = tuple(params)
        return len(params) == len(self.entries) and all(
            p is kept and p.data_ptr() == data.data_ptr() and p._version == version
            for p, (kept, data, version) in zip(params, self.entries))

"""Handing one compiled kernel to every module of a kind (SnakeBeta, code2wav's residual units):
built once, where it builds; modules whose inputs it does not take keep their torch ops."""

from __future__ import annotations

import logging
from typing import Callable

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

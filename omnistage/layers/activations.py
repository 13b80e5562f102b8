"""GELU (the erf form) without oneDNN.

PyTorch runs F.gelu's erf form on a contiguous float32 CPU tensor as a oneDNN eltwise
primitive, made for each input shape and kept with oneDNN's other primitives. Where the shapes
follow the requests (code2wav's ConvNeXt blocks at every window length, audio encoders at
every utterance length, vision encoders at every image size) a server makes new ones for as
long as it serves (1940 GELU primitive calls over ~60 shapes in 40 s of tiny Qwen3-Omni chat
with speech). Here the same function is ATen's own elementwise kernels: x / 2 * (1 + erf(x /
sqrt 2)), as transformers' exact GELU, within float rounding of F.gelu."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def gelu(x: torch.Tensor) -> torch.Tensor:
    """The exact (erf) GELU of x, any shape. F.gelu itself where oneDNN does not take it (off
    the CPU: one fused kernel) and for other dtypes (bfloat16 rounded once, from float32, as
    F.gelu rounds it, not after every step of the formula)."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return F.gelu(x)
    y = x * (1.0 / math.sqrt(2.0))
    return y.erf_().add_(1.0).mul_(x).mul_(0.5)

"""Qwen3-Omni code2wav's residual unit as one native pass (code2wav_unit.c): SnakeBeta, dilated
causal convolution, SnakeBeta, pointwise convolution and the residual add over time-major
activations (B, L, C), without the four intermediate tensors of the torch ops."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from omnistage.kernels.build import build_library, narrow_vectors
from omnistage.kernels.linear import pointer

SOURCE = Path(__file__).with_name("code2wav_unit.c")
CHANNEL_MULTIPLE = 16          # the kernel's register tiles take 16 channels at a time


@dataclass(frozen=True)
class UnitWeights:
    """One unit's parameters in the kernel's layout (float32, contiguous, CPU)."""

    conv1: torch.Tensor            # (K, C, C): [tap][in][out] of the dilated conv's (out, in, K)
    bias1: torch.Tensor | None     # (C,)
    dilation: int
    conv2: torch.Tensor            # (C, C): [in][out] of the pointwise conv's (out, in, 1)
    bias2: torch.Tensor | None     # (C,)
    snake1: tuple[torch.Tensor, torch.Tensor]   # (exp(alpha), 1 / (exp(beta) + 1e-9)), (C,) each
    snake2: tuple[torch.Tensor, torch.Tensor]

    @property
    def channels(self) -> int:
        return self.conv2.shape[0]


class Code2WavUnitKernel:
    """The compiled kernel (raises NativeBuildError where it does not build).

    wide_vectors=False builds the AVX2-width path (8-lane tiles of 6 steps) even on a CPU with
    AVX-512 (16-lane tiles of 12 steps): the same sums in the same order, so the same bits."""

    def __init__(self, wide_vectors: bool = True):
        defines, flags = ({}, ()) if wide_vectors else narrow_vectors()
        lib = ctypes.CDLL(str(build_library(SOURCE, defines, flags)))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.code2wav_unit
        self._fn.argtypes = [p, p, i64, i64, i64, i64, i64, p, p, i64, i64, p, p, p, p, p, p]
        self._fn.restype = ctypes.c_int

    @staticmethod
    def supports(x: torch.Tensor, channels: int) -> bool:
        """Whether the kernel takes `x` as it is: float32 (B, L, C) on the CPU with unit-stride
        channels, C a multiple of CHANNEL_MULTIPLE."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 3
                and x.shape[2] == channels and channels % CHANNEL_MULTIPLE == 0 and x.stride(2) == 1)

    def __call__(self, x: torch.Tensor, w: UnitWeights) -> torch.Tensor:
        """x (B, L, C) as `supports` takes it -> y (B, L, C) contiguous."""
        if not self.supports(x, w.channels):
            raise ValueError(f"code2wav unit kernel: x {tuple(x.shape)} {x.dtype} on {x.device}, "
                             f"strides {x.stride()}, for {w.channels} channels")
        y = torch.empty(x.shape, dtype=torch.float32)
        if y.numel() == 0:
            return y
        b, length, c = x.shape
        rc = self._fn(x.data_ptr(), y.data_ptr(), b, length, c, x.stride(0), x.stride(1),
                      w.conv1.data_ptr(), pointer(w.bias1), w.conv1.shape[0], w.dilation,
                      w.conv2.data_ptr(), pointer(w.bias2), w.snake1[0].data_ptr(), w.snake1[1].data_ptr(),
                      w.snake2[0].data_ptr(), w.snake2[1].data_ptr())
        if rc != 0:
            raise MemoryError("code2wav unit kernel: no memory for its scratch")
        return y

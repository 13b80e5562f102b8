"""SnakeBeta as one native pass (snake.c): y = x + inv_mag * sin(freq * x)^2 per channel, over
channel-major (B, C, L) or time-major (B, L, C) activations."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from omnistage.kernels.build import build_library

SOURCE = Path(__file__).with_name("snake.c")


class SnakeKernel:
    """The compiled kernel (raises NativeBuildError where it does not build); shape-free, so
    one serves every activation of a model."""

    def __init__(self):
        lib = ctypes.CDLL(str(build_library(SOURCE, {})))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.snake_beta
        self._fn.argtypes = [p, p, p, p, i64, i64, i64, i64, i64]
        self._fn.restype = None
        self._fn_tm = lib.snake_beta_time_major
        self._fn_tm.argtypes = [p, p, p, p, i64, i64, i64, i64, i64]
        self._fn_tm.restype = None

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """Whether the kernel takes `x` as it is: float32, 3-D, on the CPU."""
        return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 3

    def __call__(self, x: torch.Tensor, freq: torch.Tensor, inv_mag: torch.Tensor) -> torch.Tensor:
        """x (B, C, L) float32 on the CPU (see supports), any strides; freq, inv_mag (C,)
        float32 -> y (B, C, L) contiguous."""
        return self._run(self._fn, x, freq, inv_mag, x.shape[1])

    def time_major(self, x: torch.Tensor, freq: torch.Tensor, inv_mag: torch.Tensor) -> torch.Tensor:
        """x (B, L, C) float32 on the CPU (see supports), any strides; freq, inv_mag (C,)
        float32 -> y (B, L, C) contiguous."""
        return self._run(self._fn_tm, x, freq, inv_mag, x.shape[2])

    @staticmethod
    def _run(fn, x: torch.Tensor, freq: torch.Tensor, inv_mag: torch.Tensor, c: int) -> torch.Tensor:
        """fn over x (B, M, N): M rows of N unit-stride values each, at any batch and row
        strides; c: the channels freq and inv_mag must have."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        # The C code trusts the shapes (a wrong one reads out of bounds rather than raising).
        if freq.shape != (c,) or inv_mag.shape != (c,) or freq.dtype != torch.float32:
            raise ValueError(f"snake kernel: x {tuple(x.shape)}, freq {tuple(freq.shape)}, "
                             f"inv_mag {tuple(inv_mag.shape)}")
        freq, inv_mag = freq.contiguous(), inv_mag.contiguous()
        y = torch.empty(x.shape, dtype=torch.float32)
        if y.numel():
            fn(x.data_ptr(), y.data_ptr(), freq.data_ptr(), inv_mag.data_ptr(), *x.shape,
               x.stride(0), x.stride(1))
        return y

"""BigVGAN's anti-aliased SnakeBeta (upsample x2, SnakeBeta, low-pass and downsample x2, one
FIR both ways) as one native pass over time-major activations (aa_snake.c)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from omnistage.kernels.build import build_library

SOURCE = Path(__file__).with_name("aa_snake.c")
MAX_TAPS = 64                 # aa_snake.c's MAX_TAPS
# Scratch per task: ~(2 T + 18) rows of C floats for T output steps; T keeps it in L2 (~200 KB
# at C = 768), at least 16 so the tile's 6-row margins stay a small share.
SCRATCH_FLOATS = 16384


class AntiAliasedSnakeKernel:
    """The compiled kernel (raises NativeBuildError where it does not build); shape-free, so
    one serves every activation of a model."""

    def __init__(self):
        lib = ctypes.CDLL(str(build_library(SOURCE, {})))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.aa_snake_time_major
        self._fn.argtypes = [p, p, p, i64, p, p, i64, i64, i64, i64, i64, i64]
        self._fn.restype = ctypes.c_int

    @staticmethod
    def supports(x: torch.Tensor, taps: int) -> bool:
        """Whether the kernel takes `x` as it is: float32, 3-D, on the CPU, with an even filter
        of 4..MAX_TAPS taps."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 3
                and taps % 2 == 0 and 4 <= taps <= MAX_TAPS)

    def __call__(self, x: torch.Tensor, fir: torch.Tensor, freq: torch.Tensor,
                 inv_mag: torch.Tensor) -> torch.Tensor:
        """x (B, L, C) float32 on the CPU (see supports), any batch and step strides; fir
        (taps,), freq and inv_mag (C,) float32 -> y (B, L, C) contiguous."""
        b, n, c = x.shape
        if x.stride(-1) != 1:
            x = x.contiguous()
        # The C code trusts the shapes (a wrong one reads out of bounds rather than raising).
        if (freq.shape != (c,) or inv_mag.shape != (c,) or fir.dim() != 1 or not self.supports(x, fir.numel())
                or fir.dtype != torch.float32 or freq.dtype != torch.float32 or inv_mag.dtype != torch.float32):
            raise ValueError(f"anti-aliased snake kernel: x {tuple(x.shape)} {x.dtype}, fir {tuple(fir.shape)}, "
                             f"freq {tuple(freq.shape)}, inv_mag {tuple(inv_mag.shape)}")
        fir, freq, inv_mag = fir.contiguous(), freq.contiguous(), inv_mag.contiguous()
        y = torch.empty((b, n, c), dtype=torch.float32)
        if not y.numel():
            return y
        rows = max(16, SCRATCH_FLOATS // c)
        rows = min(rows, max(16, -(-b * n // (4 * torch.get_num_threads()))))   # tasks for every thread
        if self._fn(x.data_ptr(), y.data_ptr(), fir.data_ptr(), fir.numel(), freq.data_ptr(),
                    inv_mag.data_ptr(), b, n, c, x.stride(0), x.stride(1), rows) != 0:
            raise MemoryError("anti-aliased snake kernel: no memory for its scratch")
        return y

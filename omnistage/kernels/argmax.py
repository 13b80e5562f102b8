"""Row argmax as torch.argmax answers it, in one native call (argmax.c): greedy decoding's
choice over a step's logits."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from omnistage.kernels.build import build_library

SOURCE = Path(__file__).with_name("argmax.c")


class ArgmaxKernel:
    """The compiled kernel (raises NativeBuildError where it does not build). Called on what it
    does not take (see supports), it answers with torch.argmax: callers need not check."""

    def __init__(self):
        lib = ctypes.CDLL(str(build_library(SOURCE, {})))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.argmax_rows
        self._fn.argtypes = [p, i64, i64, i64, p]
        self._fn.restype = None
        self._penalized = lib.penalized_argmax_rows
        self._penalized.argtypes = [p, i64, i64, i64, p, p, p, p, p, p, i64, p]
        self._penalized.restype = None

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """float32 (B, V) on the CPU with V >= 1 and unit stride along V."""
        return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
                and x.shape[1] >= 1 and x.stride(1) == 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, V) -> (B,) int64: each row's first index of its largest value (of its first NaN
        where it has one), as x.argmax(dim=-1)."""
        if not self.supports(x):
            return x.argmax(dim=-1)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        if x.shape[0]:
            self._fn(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr())
        return out

    def greedy(self, x: torch.Tensor, banned: list[torch.Tensor], seen: list[torch.Tensor],
               penalties: list[float]) -> torch.Tensor:
        """x (B, V) float32 (see supports; not modified) -> (B,) int64: each row's argmax after
        its banned ids (int64, 1-D) are set to -inf and HF's repetition penalty penalties[i]
        is applied to the ids it has seen (int64, 1-D, repeats allowed), as the sampler's torch
        path computes them (argmax.c's penalized_argmax_rows: the same token)."""
        rows, n = x.shape
        if not (self.supports(x) and len(banned) == len(seen) == len(penalties) == rows
                and all(t.dtype == torch.int64 and t.dim() == 1 and t.is_contiguous() for t in (*banned, *seen))):
            raise ValueError("penalized argmax: x (B, V) float32 on the CPU and, per row, 1-D int64 "
                             "banned and seen ids and a penalty")
        width = n + max((t.numel() for t in seen), default=0)
        work = torch.empty(rows * width)
        pointers = ctypes.c_void_p * rows
        counts = ctypes.c_int64 * rows
        out = torch.empty(rows, dtype=torch.int64)
        if rows:
            self._penalized(x.data_ptr(), rows, n, x.stride(0), pointers(*(t.data_ptr() for t in banned)),
                            counts(*(t.numel() for t in banned)), pointers(*(t.data_ptr() for t in seen)),
                            counts(*(t.numel() for t in seen)), (ctypes.c_float * rows)(*penalties),
                            work.data_ptr(), width, out.data_ptr())
        return out

"""Linear layers as native calls over weights packed in 64-column panels (linear.c): one
layout that streams at memory speed for a single row and runs a register-tiled GEMM for many,
with every row's result independent of the batch around it."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from omnistage.kernels.build import build_library

SOURCE = Path(__file__).with_name("linear.c")
PANEL = 64  # output columns per panel (linear.c)


def unsupported_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve these weights (None: it can)."""
    if device.type != "cpu":
        return f"it runs on CPUs (the weights are on {device})"
    if dtype != torch.float32:
        return f"it reads float32 weights (these are {str(dtype).removeprefix('torch.')})"
    return None


class NativeLinearKernel:
    """The compiled kernel; shape-free, so one serves every layer of a model."""

    def __init__(self):
        lib = ctypes.CDLL(str(build_library(SOURCE, {})))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._linear = lib.linear_f32
        self._linear.argtypes = [p, i64, p, p, p, i64, i64, i64, i64]
        self._linear.restype = None

    @staticmethod
    def pack(weight_t: torch.Tensor) -> torch.Tensor:
        """(in, out) weight -> (ceil(out / 64), in, 64) panels, zero-padded past `out`."""
        k, n = weight_t.shape
        padded = weight_t.new_zeros(k, -(-n // PANEL) * PANEL)
        padded[:, :n] = weight_t
        return padded.view(k, -1, PANEL).transpose(0, 1).contiguous()

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
        """x (..., in) -> (..., out_features)."""
        k = panels.shape[1]
        flat = x.reshape(-1, k)
        if flat.stride(-1) != 1 or flat.dtype != torch.float32:
            flat = flat.contiguous().float()
        # The C code trusts these (a wrong one reads out of bounds rather than raising).
        assert x.shape[-1] == k and panels.is_contiguous() and panels.dtype == torch.float32
        assert panels.shape[0] * PANEL >= out_features and panels.shape[2] == PANEL
        assert bias is None or (bias.is_contiguous() and bias.shape == (out_features,))
        y = torch.empty(flat.shape[0], out_features, dtype=torch.float32)
        if flat.shape[0]:
            self._linear(flat.data_ptr(), flat.stride(0), panels.data_ptr(),
                         None if bias is None else bias.data_ptr(), y.data_ptr(), y.stride(0),
                         flat.shape[0], out_features, k)
        return y.view(*x.shape[:-1], out_features)

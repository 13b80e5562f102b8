"""Linear layers as native calls over weights packed in 64-column panels (linear.c): one
layout that streams at memory speed for a single row and runs a register-tiled GEMM for many,
with every row's result independent of the batch around it."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from omnistage.kernels.build import build_library, pick_native

SOURCE = Path(__file__).with_name("linear.c")
PANEL = 64  # output columns per panel (linear.c)


def unsupported_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve these weights (None: it can)."""
    if device.type != "cpu":
        return f"it runs on CPUs (the weights are on {device})"
    if dtype != torch.float32:
        return f"it reads float32 weights (these are {str(dtype).removeprefix('torch.')})"
    return None


def native_linear_kernel(want: str, device: torch.device, dtype: torch.dtype
                         ) -> tuple[NativeLinearKernel | None, str | None]:
    """For `linear_kernel` = want (auto or native): the kernel, or (None, why it cannot serve
    here); `native` that cannot serve raises InvalidRequestError."""
    return pick_native("linear_kernel", want, unsupported_reason(device, dtype), NativeLinearKernel,
                       "auto, onednn or matmul")


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
        assert weight_t.dtype == torch.float32
        if n % PANEL == 0 and weight_t.is_contiguous():   # no padded copy (a real lm_head is GBs)
            return weight_t.view(k, -1, PANEL).transpose(0, 1).contiguous()
        padded = weight_t.new_zeros(k, -(-n // PANEL) * PANEL)
        padded[:, :n] = weight_t
        return padded.view(k, -1, PANEL).transpose(0, 1).contiguous()

    def __call__(self, x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
        """x (..., in) -> (..., out_features). `panels` come from `pack`; bias: (out_features,)
        contiguous or None. Called ~50 times per decode step: checks stay minimal."""
        k = panels.shape[1]
        if x.dim() != 2 or not x.is_contiguous():
            return self(x.reshape(-1, k).contiguous(), panels, bias, out_features).view(
                *x.shape[:-1], out_features)
        m = x.shape[0]
        # The C code trusts the shapes (a wrong one reads out of bounds rather than raising).
        if x.shape[1] != k or x.dtype != torch.float32:
            raise ValueError(f"native linear: input {tuple(x.shape)} {x.dtype}, weight in_features {k}")
        y = torch.empty(m, out_features, dtype=torch.float32)
        if m:
            self._linear(x.data_ptr(), k, panels.data_ptr(), bias if bias is None else bias.data_ptr(),
                         y.data_ptr(), out_features, m, out_features, k)
        return y

"""RMSNorm as native calls (decoder_stack.c's own norms, exported), for models whose layers run
op by op (the MoE thinker and talker of Qwen3-Omni). Why: torch's F.rms_norm on a CPU is a
chain of elementwise ops, each an OpenMP region: 220 rows of 512 took ~50 us, 27 rows ~19 us
(2 threads), four times per layer plus the per-head q and k norms, whose results were copied
back into the fused q|k|v row. One pass per row here, in place for the head norms."""

from __future__ import annotations

import ctypes

import torch

from omnistage.kernels.build import build_library
from omnistage.kernels.decoder_stack import SOURCE

_p, _i64, _f64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double


class NormKernel:
    """rms_norm (rows) and head_norms (q and k heads of fused rows, in place), float32 on CPU."""

    def __init__(self):
        lib = ctypes.CDLL(str(build_library(SOURCE, {})))
        self._rms = lib.rmsnorm_f32
        self._rms.argtypes = [_p, _p, _p, _i64, _i64, _f64]
        self._heads = lib.head_norms_f32
        self._heads.argtypes = [_p, _i64, _i64, _i64, _i64, _i64, _p, _p, _f64]
        self._rms.restype = self._heads.restype = None

    @staticmethod
    def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether the kernel takes x (.., n) with weight (n,): float32 CPU, rows contiguous."""
        return (x.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
                and x.is_contiguous() and weight.is_contiguous() and x.shape[-1] == weight.shape[0])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x (.., n) -> x / sqrt(mean(x^2) + eps) * weight, a new tensor (check `supports`)."""
        y = torch.empty_like(x)
        n = weight.shape[0]
        self._rms(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // n, n, eps)
        return y

    def head_norms(self, qkv: torch.Tensor, heads: int, kv_heads: int, q_weight: torch.Tensor,
                   k_weight: torch.Tensor, eps: float) -> bool:
        """The first `heads` heads of each row of qkv (T, width) normalised with q_weight, the
        next `kv_heads` with k_weight (head_dim each), in place. False (nothing done) where the
        layout does not fit: unit-stride rows of float32 on CPU, float32 weights."""
        d = q_weight.shape[0]
        if not (qkv.device.type == "cpu" and qkv.dtype == q_weight.dtype == k_weight.dtype == torch.float32
                and qkv.dim() == 2 and qkv.stride(1) == 1 and qkv.shape[1] >= (heads + kv_heads) * d
                and k_weight.shape[0] == d and q_weight.is_contiguous() and k_weight.is_contiguous()):
            return False
        self._heads(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], heads, kv_heads, d,
                    q_weight.data_ptr(), k_weight.data_ptr(), eps)
        return True

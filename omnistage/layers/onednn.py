"""oneDNN's packed fp32 (and bf16) linear (CPU), in one place: the weight is reordered once
into oneDNN's blocked layout, and every product runs its AVX-512 GEMM, 2-3x torch's default
fp32 BLAS path on the CPUs we serve from. These are torch's private `mkldnn` ops (what its
CPU compiler emits); only this module calls them."""

from __future__ import annotations

import torch


def onednn_linear_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's packed linear serves fp32 on CPUs of torch builds that include it."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def onednn_bf16_available() -> bool:
    """oneDNN runs bf16 GEMMs natively (AVX-512 BF16 or AMX); elsewhere it would emulate them,
    slower than fp32."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) weight -> oneDNN's blocked layout (an opaque tensor for packed_linear)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                  post_op: str = "none", algorithm: str = "") -> torch.Tensor:
    """x (..., in) @ W^T (+ bias), then `post_op` fused into the GEMM ("none", or e.g. "gelu"
    with algorithm "tanh"). Leading dimensions are kept."""
    flat = x.reshape(-1, x.shape[-1])
    y = torch.ops.mkldnn._linear_pointwise(flat, packed, bias, post_op, [], algorithm)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], y.shape[-1])

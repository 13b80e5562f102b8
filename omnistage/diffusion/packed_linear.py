"""oneDNN-packed fp32 linear layers for the denoising transformers on CPU.

A diffusion transformer's time is mostly GEMMs with thousands of rows (image tokens x batch).
On the CPUs we serve from, torch's default fp32 path for `F.linear` stays on AVX2 while
oneDNN's blocked-weight GEMM uses AVX-512: measured 50-75 vs 170-210 GFLOP/s on one core for
the small Qwen-Image shapes (2,600 x 512 x 512..2048). `pack_linears` swaps each `nn.Linear`
of a model instance for a `PackedLinear` holding the weight in oneDNN's layout, through
nn.Module's public child replacement (the same way quantization swaps layers); nothing in
diffusers is patched, and the swap is one visible call at stage build time (`linear_kernel`).
Outputs differ from `F.linear` by float rounding only (relative ~1e-6).
"""

from __future__ import annotations

import torch
from torch import nn

from omnistage.layers.linear import replace_linears
from omnistage.layers.onednn import onednn_linear_available, pack_weight, packed_linear


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        w = linear.weight.detach()                                    # (out, in)
        self.packed = pack_weight(w)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # Models read `.weight.dtype` / `.device` of their layers (e.g. to cast inputs): an
        # empty stand-in answers those; anything that needs the values fails loudly.
        self.register_buffer("weight", w.new_empty(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def pack_linears(model: nn.Module) -> int:
    """Replace every fp32 CPU `nn.Linear` in `model` by a PackedLinear; returns how many.
    A no-op where oneDNN's packed linear is unavailable (GPU, other dtypes)."""
    return replace_linears(model, PackedLinear,
                           lambda m: onednn_linear_available(m.weight.device, m.weight.dtype))

"""RMSNorm as the reference models compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels.norms import NormKernel


class RMSNorm(nn.Module):
    """Normalises in float32 and scales in the input dtype, as the reference models do."""

    kernel: NormKernel | None = None     # native rows where set (llm/runner_builder: CPU, native linears)

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device="meta"):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and self.kernel.supports(x, self.weight):
            return self.kernel.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op; same math as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

"""The gated MLP of Qwen-style decoders: down(silu(gate(x)) * up(x)), gate|up merged in one
product (TransposedLinear shards: checkpoint gate_proj, up_proj -> gate_up; down_proj -> down)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers.linear import TransposedLinear


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype):
        super().__init__()
        self.gate_up = TransposedLinear(hidden, [intermediate] * 2, bias=False, dtype=dtype)
        self.down = TransposedLinear(intermediate, [hidden], bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, hidden) -> (T, hidden)."""
        return self.down(swiglu_activation(self.gate_up(x)))


def swiglu_activation(gate_up: torch.Tensor) -> torch.Tensor:
    """(R, 2I) gate | up rows -> (R, I) silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)

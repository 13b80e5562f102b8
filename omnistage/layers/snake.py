"""SnakeBeta, the periodic activation of BigVGAN-style vocoders (Qwen2.5-Omni's BigVGAN,
Qwen3-Omni's code2wav): x + sin^2(x * e^alpha) / (e^beta + 1e-9), per channel, with alpha and
beta stored as logs (the checkpoints' `alpha` / `beta`)."""

from __future__ import annotations

import torch
from torch import nn

from omnistage.kernels.snake import SnakeKernel
from omnistage.layers.native_kernel import ParameterState, attach_kernel


class SnakeBeta(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.alpha = nn.Parameter(torch.zeros(channels), requires_grad=False)    # log frequency
        self.beta = nn.Parameter(torch.zeros(channels), requires_grad=False)     # log magnitude
        self.kernel: SnakeKernel | None = None       # set by use_native_snake
        # parameters_for_kernel's (freq, inv_mag) and the parameters they came from
        self._for_kernel: tuple[ParameterState, tuple[torch.Tensor, torch.Tensor]] | None = None

    def parameters_for_kernel(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(freq, inv_mag), (C,) float32 contiguous: exp(alpha) and 1 / (exp(beta) + 1e-9),
        computed again only after alpha or beta changed (ParameterState). A BigVGAN forward
        asks 108 times, and the eight small torch ops each time were ~2 ms of a 45 ms first
        chunk."""
        params = (self.alpha, self.beta)
        if self._for_kernel is None or not self._for_kernel[0].matches(params):
            freq = self.alpha.detach().float().exp().contiguous()
            inv_mag = (1.0 / (self.beta.detach().float().exp() + 1e-9)).contiguous()
            self._for_kernel = (ParameterState.of(params), (freq, inv_mag))
        return self._for_kernel[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, L) -> (B, C, L)."""
        freq = self.alpha.exp()                              # (C,)
        inv_mag = 1.0 / (self.beta.exp() + 1e-9)
        if self.kernel is not None and self.kernel.supports(x):
            return self.kernel(x, freq, inv_mag)             # one pass (kernels/snake.c)
        # Four passes over x's size and two new tensors, not five and four: at 24 kHz these
        # are a vocoder's largest tensors (1.5-3x faster than the naive form; the same values
        # within 1e-6).
        s = torch.mul(x, freq.unsqueeze(-1)).sin_()
        return torch.addcmul(x, s.mul_(s), inv_mag.unsqueeze(-1))


class TimeMajorSnakeBeta(SnakeBeta):
    """SnakeBeta over time-major activations (B, L, C): the layout a channels-last convolution
    stack keeps (Qwen3-Omni's code2wav), with the channel-major module's parameters."""

    scale = 1          # a step of a causal stack (code2wav's CausalStep): pointwise

    @staticmethod
    def needs_from(out_from: int) -> int:
        return out_from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, C) -> (B, L, C), any strides in; contiguous out."""
        freq = self.alpha.exp()                              # (C,)
        inv_mag = 1.0 / (self.beta.exp() + 1e-9)
        if self.kernel is not None and self.kernel.supports(x):
            return self.kernel.time_major(x, freq, inv_mag)
        s = torch.mul(x, freq).sin_()
        return torch.addcmul(x, s.mul_(s), inv_mag).contiguous()


def use_native_snake(model: nn.Module) -> int:
    """Run every SnakeBeta of `model` through the native one-pass kernel where it builds (2-3x
    faster on a vocoder's 24 kHz activations; float32 CPU inputs only, others keep the torch
    path; values within 1e-6 of it). -> how many activations took it (0: it did not build)."""
    return attach_kernel(model, SnakeBeta, SnakeKernel, "SnakeBeta activations")

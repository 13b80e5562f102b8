"""Time-major convolutions: activations (B, L, C) contiguous, each 1-D convolution of a vocoder
run as the 2-D convolution of the (B, C, 1, L) channels-last view of that memory.

Why: with PyTorch's default (B, C, L) layout oneDNN reorders every input into its blocked
format and every output back; at a vocoder's 24 kHz with few channels those reorders cost as
much as the convolutions (38% of Qwen3-Omni code2wav's oneDNN time, measured), and a depthwise
resampling filter ran 3-9x slower (BigVGAN's anti-aliased activations). Channels-last, oneDNN
convolves the memory as it is. The weights stay the nn.Conv1d / nn.ConvTranspose1d modules'
(checkpoint names and shapes unchanged)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """(B, L, C) -> the (B, C, 1, L) view a 2-D convolution reads as channels-last (no copy
    when x is contiguous)."""
    return x.unsqueeze(1).permute(0, 3, 1, 2)


def time_major(y: torch.Tensor) -> torch.Tensor:
    """A convolution's channels-last (B, C, 1, L) output -> (B, L, C) (a view)."""
    return y.permute(0, 2, 3, 1).flatten(1, 2)


def conv1d(conv: nn.Conv1d, x: torch.Tensor, padding: int | None = None) -> torch.Tensor:
    """`conv` over time-major x (B, L, Cin) -> (B, L', Cout); `padding` (both ends) replaces
    the module's own."""
    pad = conv.padding[0] if padding is None else padding
    return time_major(F.conv2d(channels_last(x), conv.weight.unsqueeze(2), conv.bias,
                               stride=(1, conv.stride[0]), padding=(0, pad),
                               dilation=(1, conv.dilation[0]), groups=conv.groups))


def conv_transpose1d(conv: nn.ConvTranspose1d, x: torch.Tensor, padding: int | None = None) -> torch.Tensor:
    """`conv` over time-major x (B, L, Cin) -> (B, L', Cout); `padding` (cut from both ends)
    replaces the module's own."""
    pad = conv.padding[0] if padding is None else padding
    return time_major(F.conv_transpose2d(channels_last(x), conv.weight.unsqueeze(2), conv.bias,
                                         stride=(1, conv.stride[0]), padding=(0, pad),
                                         output_padding=(0, conv.output_padding[0]),
                                         groups=conv.groups, dilation=(1, conv.dilation[0])))


def replicate_pad(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """Time-major x (B, L, C) with its first step repeated `left` times before it and its last
    `right` times after (F.pad's replicate mode, along L)."""
    parts = [x[:, :1].expand(-1, left, -1)] if left else []
    parts.append(x)
    if right:
        parts.append(x[:, -1:].expand(-1, right, -1))
    return torch.cat(parts, 1) if len(parts) > 1 else x

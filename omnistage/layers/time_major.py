"""Time-major convolutions of the vocoders: activations (B, L, C) contiguous, each convolution
run without oneDNN (TimeMajorConv): in the native time-major kernel (kernels/conv1d_tm.c)
where it serves the convolution, else as matrix products (layers/conv_products.py).

Why time-major: in PyTorch's (B, C, L) layout oneDNN reordered every input into its blocked
format and every output back; at a vocoder's 24 kHz with few channels those reorders cost as
much as the convolutions (38% of Qwen3-Omni code2wav's oneDNN time, measured). Why not oneDNN
at all: it builds and keeps a primitive per input shape, and a stream's windows come in ever
new shapes: a server's memory grew without end (conv_products' docstring). The weights stay the
nn.Conv1d / nn.ConvTranspose1d modules' (checkpoint names and shapes unchanged).

The channels-last helpers serve what still runs in oneDNN where no native kernel builds (the
depthwise resampling filters of BigVGAN's anti-aliased activations): the (B, C, 1, L) view of
time-major memory is what a 2-D convolution reads as channels-last, with no reorder."""

from __future__ import annotations

import torch
from torch import nn

from omnistage.kernels.conv1d_tm import (PackedConv, PackedDepthwise, PackedTransposed, TimeMajorConvKernel,
                                         transposed_cut)
from omnistage.layers import conv_products
from omnistage.layers.native_kernel import ParameterState

Packed = PackedConv | PackedDepthwise | PackedTransposed


class TimeMajorConv:
    """Runs one nn.Conv1d (stride 1; one group or depthwise) or nn.ConvTranspose1d (one group,
    no dilation or output padding; `cut` outputs cut from each end, default its padding) over
    time-major x: by the kernel a caller passes where it serves the convolution (packed weights
    up to its MAX_WEIGHT_BYTES; depthwise always) and takes x (float32 CPU, unit-stride
    channels), else as matrix products, on any device and dtype. The module stays its owner's
    (registered there); the packed weights and the products' matrix are derived from it again
    after any parameter changed (ParameterState)."""

    def __init__(self, conv: nn.Conv1d | nn.ConvTranspose1d, cut: int | None = None):
        self.conv = conv
        self.transposed = isinstance(conv, nn.ConvTranspose1d)
        self.cut = transposed_cut(conv, cut) if self.transposed else None
        self.taps = conv_products.TapMatrix()
        self._packed: tuple[ParameterState, Packed | None] | None = None

    def packed(self) -> Packed | None:
        """The convolution in the native kernel's layout, None where the kernel does not serve
        it; packed again after a parameter changed. Owners call it when given a kernel, so the
        weights are packed at load, not amid the first step's activations: with freed memory
        retained, small lasting blocks between a step's large ones kept the heap ~80 MB larger."""
        params = list(self.conv.parameters())
        if self._packed is None or not self._packed[0].matches(params):
            c, packed = self.conv, None
            if self.transposed:
                if TimeMajorConvKernel.serves_transposed(c, self.cut):
                    packed = PackedTransposed.of(c, self.cut)
            elif c.groups == c.in_channels == c.out_channels > 1 and c.stride[0] == 1:
                packed = PackedDepthwise.of(c)
            elif TimeMajorConvKernel.serves(c):
                packed = PackedConv.of(c)
            self._packed = (ParameterState.of(params), packed)
        return self._packed[1]

    def __call__(self, x: torch.Tensor, kernel: TimeMajorConvKernel | None, left: int = 0,
                 right: int = 0) -> torch.Tensor:
        """x (B, L, Cin) -> (B, L', Cout): a Conv1d with `left` zero steps before x and `right`
        after (L' = L + left + right - reach), a ConvTranspose1d with its cut (left, right
        unused: L' = (L - 1) s + k - 2 cut)."""
        packed = self.packed() if kernel is not None and kernel.takes(x) else None
        if self.transposed:
            if isinstance(packed, PackedTransposed) and kernel.supports(x, packed.phases) \
                    and packed.plan(x.shape[1])[3] >= 1:
                return kernel.transposed(x, packed)
            return conv_products.conv_transpose1d(self.conv, x, self.taps, self.cut)
        if isinstance(packed, PackedDepthwise):
            return kernel.depthwise(x, packed, left, right)
        if packed is not None and kernel.supports(x, packed):
            return kernel(x, packed, left, right)
        return conv_products.conv1d(self.conv, x, self.taps, left, right)


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """(B, L, C) -> the (B, C, 1, L) view a 2-D convolution reads as channels-last (no copy
    when x is contiguous)."""
    return x.unsqueeze(1).permute(0, 3, 1, 2)


def time_major(y: torch.Tensor) -> torch.Tensor:
    """A convolution's channels-last (B, C, 1, L) output -> (B, L, C) (a view)."""
    return y.permute(0, 2, 3, 1).flatten(1, 2)


def replicate_pad(x: torch.Tensor, left: int, right: int) -> torch.Tensor:
    """Time-major x (B, L, C) with its first step repeated `left` times before it and its last
    `right` times after (F.pad's replicate mode, along L)."""
    parts = [x[:, :1].expand(-1, left, -1)] if left else []
    parts.append(x)
    if right:
        parts.append(x[:, -1:].expand(-1, right, -1))
    return torch.cat(parts, 1) if len(parts) > 1 else x

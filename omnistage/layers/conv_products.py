"""Time-major 1-D convolutions as matrix products: activations (B, L, C), one GEMM over every
step of every row, then a few shifted sums of its output.

Why not oneDNN (layers/time_major.py): oneDNN builds a primitive for every input shape it
meets (~0.3 ms per convolution for a new one) and keeps it, with descriptors of its own that
outlive its cache; a streaming vocoder's steps come in ever new shapes (windows per step x
window length x layer), so a server's memory grew by ~15 MB a minute and never levelled off
(tiny Qwen3-Omni, 10 minutes of chat with speech), and a burst's first steps paid the builds.
A matrix product has no per-shape state. The products do the convolutions' arithmetic (up to
float rounding: the sums run in another order), on any device.

Shapes. A convolution's weight is read as one matrix (Cin, taps * Cout) (TapMatrix); x
(B * L, Cin) times it gives every tap's contribution of every input step, z (B, L, taps, Cout).
Output step t of a causal convolution sums tap j of input t - (taps - 1 - j) * dilation: z's
taps read as shifted slices. A transposed convolution of stride s gives every input step s
output steps per block of s taps: with kernel s that is z itself; with kernel 2s and s outputs
cut from each end, output block m is tap block 1 of input m plus tap block 0 of input m + 1."""

from __future__ import annotations

import torch
from torch import nn

from omnistage.kernels.conv1d_tm import is_trimmed_transposed
from omnistage.layers.native_kernel import ParameterState


class TapMatrix:
    """A convolution's weight as the matrix (Cin, taps * Cout), [in][tap][out], that its
    products take; derived again only after the weight changed (a load, a move: ParameterState)."""

    def __init__(self) -> None:
        self._derived: tuple[ParameterState, torch.Tensor] | None = None

    def __call__(self, conv: nn.Conv1d | nn.ConvTranspose1d) -> torch.Tensor:
        w = conv.weight
        if self._derived is None or not self._derived[0].matches((w,)):
            # Conv1d weights are (Cout, Cin, taps); ConvTranspose1d's (Cin, Cout, taps)
            in_tap_out = w.permute(0, 2, 1) if isinstance(conv, nn.ConvTranspose1d) else w.permute(1, 2, 0)
            matrix = in_tap_out.detach().reshape(in_tap_out.shape[0], -1).contiguous()
            self._derived = (ParameterState.of((w,)), matrix)
        return self._derived[1]


def causal_conv1d(conv: nn.Conv1d, x: torch.Tensor, taps: TapMatrix) -> torch.Tensor:
    """`conv` (stride 1; one group, or depthwise) over time-major x (B, L, Cin), left-padded
    with zeros by its reach (kernel - 1) * dilation -> (B, L, Cout): output t reads inputs
    t - reach .. t. `taps`: the conv's TapMatrix (unused for a depthwise one). ValueError for a
    stride or grouping it does not take."""
    if conv.stride[0] != 1:
        raise ValueError(f"a causal convolution as products takes stride 1; got {conv.stride[0]}")
    if conv.groups == 1:
        b, n, cin = x.shape
        k, cout = conv.kernel_size[0], conv.out_channels
        z = (x.reshape(b * n, cin) @ taps(conv)).view(b, n, k, cout)
        return _shifted_sum(z, conv.dilation[0], conv.bias)
    if conv.groups == conv.in_channels == conv.out_channels:
        return _depthwise(conv, x)
    raise ValueError(f"a causal convolution as products takes one group or depthwise; got "
                     f"{conv.groups} groups of {conv.in_channels} -> {conv.out_channels} channels")


def trimmed_conv_transpose1d(conv: nn.ConvTranspose1d, x: torch.Tensor, taps: TapMatrix) -> torch.Tensor:
    """`conv` (kernel k = s or 2s for stride s; one group, no dilation) with k - s outputs cut
    from each end, over time-major x (B, L, Cin) -> (B, L * s - (k - s), Cout). `taps`: the
    conv's TapMatrix. ValueError for another kernel, grouping or dilation."""
    k, s, cout = conv.kernel_size[0], conv.stride[0], conv.out_channels
    if not is_trimmed_transposed(conv):
        raise ValueError(f"a transposed convolution as products takes one group, no dilation and "
                         f"kernel = stride or 2 x stride; got kernel {k}, stride {s}, groups "
                         f"{conv.groups}, dilation {conv.dilation[0]}")
    b, n, cin = x.shape
    z = x.reshape(b * n, cin) @ taps(conv)                           # (B * L, k * Cout)
    if k == s:
        y = z.view(b, n * s, cout)
    else:
        z = z.view(b, n, 2, s * cout)
        y = (z[:, :-1, 1] + z[:, 1:, 0]).view(b, (n - 1) * s, cout)
    return y if conv.bias is None else y.add_(conv.bias)


def _shifted_sum(z: torch.Tensor, dilation: int, bias: torch.Tensor | None) -> torch.Tensor:
    """z (B, L, taps, Cout) -> y (B, L, Cout), y[t] = bias + sum_j z[t - (taps - 1 - j) *
    dilation, j] (terms before step 0 are the zero padding's: left out)."""
    n, taps = z.shape[1], z.shape[2]
    y = z[:, :, taps - 1].clone() if bias is None else z[:, :, taps - 1] + bias
    for j in range(taps - 1):
        shift = (taps - 1 - j) * dilation
        if shift < n:
            y[:, shift:] += z[:, :n - shift, j]
    return y


def _depthwise(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """A depthwise causal convolution: y[t, c] = bias[c] + sum_j w[c, j] x[t - (taps - 1 - j) *
    dilation, c]; one multiply-add of x's shifted slices per tap."""
    w = conv.weight[:, 0]                                            # (C, taps)
    taps, d, n = w.shape[1], conv.dilation[0], x.shape[1]
    y = x * w[:, taps - 1]
    if conv.bias is not None:
        y += conv.bias
    for j in range(taps - 1):
        shift = (taps - 1 - j) * d
        if shift < n:
            y[:, shift:].addcmul_(x[:, :n - shift], w[:, j])
    return y

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
Output step t of a stride-1 convolution with `left` zero steps before x sums tap j of input
t - left + j * dilation: z's taps read as shifted slices. A transposed convolution of stride s
gives input step i's tap e * s + r to output step (i + e) * s + r before the cut: z's blocks of
s taps added at shifted blocks, then the cut steps dropped."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from omnistage.kernels.conv1d_tm import transposed_cut
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


def conv1d(conv: nn.Conv1d, x: torch.Tensor, taps: TapMatrix, left: int, right: int = 0) -> torch.Tensor:
    """`conv` (stride 1; one group, or depthwise) over time-major x (B, L, Cin) with `left` zero
    steps before it and `right` after -> (B, L + left + right - reach, Cout), reach = (kernel
    - 1) * dilation: output t reads inputs t - left .. t - left + reach. `taps`: the conv's
    TapMatrix (unused for a depthwise one). ValueError for a stride or grouping it does not
    take, or no output step."""
    reach = (conv.kernel_size[0] - 1) * conv.dilation[0]
    out_len = x.shape[1] + left + right - reach
    if conv.stride[0] != 1 or left < 0 or right < 0 or out_len < 1:
        raise ValueError(f"a convolution as products takes stride 1 and gives at least one step; got "
                         f"stride {conv.stride[0]}, {x.shape[1]} steps, padding {left} / {right}, "
                         f"reach {reach}")
    b, n, cin = x.shape
    if conv.groups == 1:
        z = (x.reshape(b * n, cin) @ taps(conv)).view(b, n, conv.kernel_size[0], conv.out_channels)
        y = _start(z, out_len, conv.bias)
        for j, lo, hi, shift in _tap_spans(conv, left, n, out_len):
            y[:, lo:hi] += z[:, lo - shift:hi - shift, j]
        return y
    if conv.groups == conv.in_channels == conv.out_channels:
        w, y = conv.weight[:, 0], _start(x, out_len, conv.bias)      # w (C, taps)
        for j, lo, hi, shift in _tap_spans(conv, left, n, out_len):
            y[:, lo:hi].addcmul_(x[:, lo - shift:hi - shift], w[:, j])
        return y
    raise ValueError(f"a convolution as products takes one group or depthwise; got "
                     f"{conv.groups} groups of {conv.in_channels} -> {conv.out_channels} channels")


def causal_conv1d(conv: nn.Conv1d, x: torch.Tensor, taps: TapMatrix) -> torch.Tensor:
    """conv1d left-padded by its reach: (B, L, Cin) -> (B, L, Cout), output t reads inputs
    t - reach .. t."""
    return conv1d(conv, x, taps, (conv.kernel_size[0] - 1) * conv.dilation[0])


def conv_transpose1d(conv: nn.ConvTranspose1d, x: torch.Tensor, taps: TapMatrix,
                     padding: int | None = None) -> torch.Tensor:
    """`conv` (one group, no dilation or output padding) with `padding` (default its own)
    outputs cut from each end, over time-major x (B, L, Cin) -> (B, (L - 1) s + k - 2 padding,
    Cout). `taps`: the conv's TapMatrix. ValueError for a form it does not take
    (kernels/conv1d_tm.transposed_cut)."""
    cut = transposed_cut(conv, padding)
    k, s, cout = conv.kernel_size[0], conv.stride[0], conv.out_channels
    b, n, cin = x.shape
    steps = max((n - 1) * s + k - 2 * cut, 0)
    first, end = cut // s, -(-(cut + steps) // s)                  # the blocks holding kept steps
    z = (x.reshape(b * n, cin) @ taps(conv)).view(b, n, k, cout)
    y = z.new_zeros(b, max(end - first, 0), s, cout)
    for e in range(-(-k // s)):                 # input i's taps e*s .. reach block i + e
        width = min(s, k - e * s)
        lo, hi = max(e, first), min(n + e, end)
        if lo < hi:
            y[:, lo - first:hi - first, :width] += z[:, lo - e:hi - e, e * s:e * s + width]
    y = y.view(b, -1, cout)[:, cut - first * s:cut - first * s + steps]
    return y if conv.bias is None else y + conv.bias


def _start(like: torch.Tensor, out_len: int, bias: torch.Tensor | None) -> torch.Tensor:
    """(B, out_len, C) of `like`'s batch, dtype and device (C its last dimension): the bias in
    every step, or zeros."""
    if bias is None:
        return like.new_zeros(like.shape[0], out_len, like.shape[-1])
    return bias.to(like.dtype).expand(like.shape[0], out_len, -1).clone()


def _tap_spans(conv: nn.Conv1d, left: int, n: int, out_len: int) -> Iterator[tuple[int, int, int, int]]:
    """(tap j, lo, hi, shift) per tap: outputs [lo, hi) read inputs [lo - shift, hi - shift)
    through tap j (output t reads input t - left + j * dilation; the other inputs a tap would
    read are the zero padding's, left out)."""
    for j in range(conv.kernel_size[0]):
        shift = left - j * conv.dilation[0]
        lo, hi = max(shift, 0), min(out_len, n + shift)
        if lo < hi:
            yield j, lo, hi, shift

"""A stride-1 1-D convolution over time-major activations (B, L, C) as one native pass
(conv1d_tm.c), its weights packed once: for vocoders' small channel counts, where oneDNN's
per-call overheads outweigh the arithmetic; its depthwise form; and a transposed convolution
as such a convolution whose output channels are the stride's phases (PackedTransposed)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from omnistage.kernels.build import build_library, narrow_vectors

SOURCE = Path(__file__).with_name("conv1d_tm.c")
COLUMN_MULTIPLE = 16           # the kernel's register tiles take 16 output channels at a time
# Packed weights up to this size: past it oneDNN's blocked kernels are faster (a task streams
# the weights for every 12 steps: at 384 channels x 11 taps, 6.3 MB, 1.9x oneDNN's time; at
# 192 x 11, 1.6 MB, 1.1x; at 192 x 3 and below, 0.94-1.03x with oneDNN's primitive made).
MAX_WEIGHT_BYTES = 512 * 1024


def transposed_cut(conv: nn.ConvTranspose1d, padding: int | None = None) -> int:
    """The outputs cut from each end of `conv` (`padding`, default the module's own) where the
    phase form (PackedTransposed) and the products (layers/conv_products.py) take it: one
    group, no dilation or output padding, 0 <= cut < kernel; a ValueError naming what else."""
    k, s = conv.kernel_size[0], conv.stride[0]
    cut = conv.padding[0] if padding is None else padding
    if conv.groups != 1 or conv.dilation[0] != 1 or conv.output_padding[0] != 0 or not 0 <= cut < k:
        raise ValueError(f"a transposed convolution the time-major kernel or the products take has one "
                         f"group, no dilation or output padding and 0 <= padding < kernel; got kernel {k}, "
                         f"stride {s}, padding {cut}, groups {conv.groups}, dilation {conv.dilation[0]}, "
                         f"output padding {conv.output_padding[0]}")
    return cut


@dataclass(frozen=True)
class PackedConv:
    """One convolution's parameters in the kernel's layout (float32, contiguous, CPU)."""

    weight: torch.Tensor           # (K, Cin, Cp): [tap][in][out], out padded with zeros to Cp
    bias: torch.Tensor | None      # (Cp,)
    out_channels: int
    dilation: int

    @classmethod
    def of(cls, conv: nn.Conv1d) -> "PackedConv":
        """`conv` (stride 1, one group) packed; a ValueError for any other convolution."""
        if conv.stride[0] != 1 or conv.groups != 1:
            raise ValueError(f"the time-major convolution kernel takes stride 1, one group; got "
                             f"stride {conv.stride[0]}, groups {conv.groups}")
        cout, cin, k = conv.weight.shape
        cp = -(-cout // COLUMN_MULTIPLE) * COLUMN_MULTIPLE
        w = torch.zeros(k, cin, cp, dtype=torch.float32)
        w[:, :, :cout] = conv.weight.detach().float().permute(2, 1, 0).cpu()
        bias = None
        if conv.bias is not None:
            bias = torch.zeros(cp, dtype=torch.float32)
            bias[:cout] = conv.bias.detach().float().cpu()
        return cls(w, bias, cout, conv.dilation[0])

    @property
    def in_channels(self) -> int:
        return self.weight.shape[1]

    @property
    def taps(self) -> int:
        return self.weight.shape[0]


@dataclass(frozen=True)
class PackedTransposed:
    """A transposed convolution (stride s, kernel k, `cut` outputs cut from each end) as a
    stride-1 convolution of T = ceil(k / s) taps whose s * Cout output channels are the
    stride's phases. Its uncut output step j = q * s + r sums inputs i = q - e through kernel
    tap e * s + r (e = 0 .. T - 1, taps past k zero), so block q of s steps reads x[q - T + 1 ..
    q]: packed tap t is e = T - 1 - t, column r * Cout + o. Only the blocks the cut leaves are
    computed (plan): a 2s kernel cutting s from each end is 2 taps over x with no padding, a
    BigVGAN upsampler (k = 11, s = 5, cut 3) 3 taps, one block more than kept."""

    phases: PackedConv             # (T, Cin, Cp)
    stride: int
    kernel: int
    cut: int
    out_channels: int

    @classmethod
    def of(cls, conv: nn.ConvTranspose1d, padding: int | None = None) -> "PackedTransposed":
        """`conv` with `padding` (default the module's own) outputs cut from each end packed;
        a ValueError for a form it does not take (transposed_cut)."""
        cut = transposed_cut(conv, padding)
        cin, cout, k = conv.weight.shape
        s = conv.stride[0]
        taps, n = -(-k // s), s * cout
        w = torch.zeros(cin, cout, taps * s, dtype=torch.float32)
        w[:, :, :k] = conv.weight.detach().float().cpu()
        blocks = w.view(cin, cout, taps, s).permute(2, 0, 3, 1).flip(0)    # (t, Cin, r, Cout)
        cp = -(-n // COLUMN_MULTIPLE) * COLUMN_MULTIPLE
        packed = torch.zeros(taps, cin, cp, dtype=torch.float32)
        packed[:, :, :n] = blocks.reshape(taps, cin, n)
        bias = None
        if conv.bias is not None:
            bias = torch.zeros(cp, dtype=torch.float32)
            bias[:n] = conv.bias.detach().float().cpu().repeat(s)
        return cls(PackedConv(packed, bias, n, 1), s, k, cut, cout)

    def plan(self, length: int) -> tuple[int, int, int, int]:
        """For x of `length` steps: (left, right, first, steps): the phase convolution's zero
        steps before and after x, and the outputs kept of its output read (B, blocks * s,
        Cout): [first, first + steps). It starts at block cut // s (left = T - 1 - that) and
        ends at the block holding the last kept step (right = ceil((k - s - cut) / s))."""
        s, k, cut = self.stride, self.kernel, self.cut
        skipped = cut // s
        right = -((s + cut - k) // s)
        return self.phases.taps - 1 - skipped, right, cut - skipped * s, (length - 1) * s + k - 2 * cut


@dataclass(frozen=True)
class PackedDepthwise:
    """A depthwise convolution's parameters in the kernel's layout (float32, contiguous, CPU)."""

    weight: torch.Tensor           # (K, C): [tap][channel]
    bias: torch.Tensor | None      # (C,)
    dilation: int

    @classmethod
    def of(cls, conv: nn.Conv1d) -> "PackedDepthwise":
        """`conv` (stride 1, one input channel per output channel) packed; a ValueError for any
        other convolution."""
        if conv.stride[0] != 1 or not conv.groups == conv.in_channels == conv.out_channels:
            raise ValueError(f"the depthwise time-major kernel takes stride 1 and one group per "
                             f"channel; got stride {conv.stride[0]}, {conv.groups} groups of "
                             f"{conv.in_channels} -> {conv.out_channels} channels")
        w = conv.weight.detach().float().cpu()[:, 0].t().contiguous()
        bias = None if conv.bias is None else conv.bias.detach().float().cpu().contiguous()
        return cls(w, bias, conv.dilation[0])

    @property
    def taps(self) -> int:
        return self.weight.shape[0]


class TimeMajorConvKernel:
    """The compiled kernel (raises NativeBuildError where it does not build); shape-free, so
    one serves every convolution of a model.

    wide_vectors=False builds the AVX2-width path (6 steps x 16 channels) even on a CPU with
    AVX-512 (12 steps x 32): the same sums in the same order, so the same bits."""

    def __init__(self, wide_vectors: bool = True):
        defines, flags = ({}, ()) if wide_vectors else narrow_vectors()
        lib = ctypes.CDLL(str(build_library(SOURCE, defines, flags)))
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = lib.conv1d_time_major
        self._fn.argtypes = [p, p, i64, i64, i64, i64, i64, p, p, i64, i64, i64, i64, i64, i64]
        self._fn.restype = ctypes.c_int
        self._depthwise = lib.depthwise_conv1d_time_major
        self._depthwise.argtypes = [p, p, i64, i64, i64, i64, i64, p, p, i64, i64, i64, i64]
        self._depthwise.restype = None

    @staticmethod
    def serves(conv: nn.Conv1d) -> bool:
        """Whether the kernel takes `conv` (stride 1, one group) and serves it well: packed
        weights up to MAX_WEIGHT_BYTES (only those are packed: no copy of larger weights)."""
        cout, cin, taps = conv.weight.shape
        cp = -(-cout // COLUMN_MULTIPLE) * COLUMN_MULTIPLE
        return conv.stride[0] == 1 and conv.groups == 1 and taps * cin * cp * 4 <= MAX_WEIGHT_BYTES

    @staticmethod
    def serves_transposed(conv: nn.ConvTranspose1d, padding: int | None = None) -> bool:
        """Whether PackedTransposed takes `conv` (with `padding`, default its own) and its packed
        weights are at most MAX_WEIGHT_BYTES."""
        try:
            transposed_cut(conv, padding)
        except ValueError:
            return False
        cin, cout, k = conv.weight.shape
        s = conv.stride[0]
        cp = -(-s * cout // COLUMN_MULTIPLE) * COLUMN_MULTIPLE
        return -(-k // s) * cin * cp * 4 <= MAX_WEIGHT_BYTES

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether the kernel's forms take activations `x` as they are: float32 (B, L, C) on the
        CPU with unit-stride channels."""
        return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 3 and x.stride(2) == 1

    @staticmethod
    def supports(x: torch.Tensor, conv: PackedConv) -> bool:
        """Whether the kernel takes `x` as it is for `conv`: `takes` it, with conv's Cin."""
        return TimeMajorConvKernel.takes(x) and x.shape[2] == conv.in_channels

    def __call__(self, x: torch.Tensor, conv: PackedConv, padding: int, right: int | None = None) -> torch.Tensor:
        """x (B, L, Cin) as `supports` takes it, `padding` zero steps before it and `right`
        (default: `padding`) after -> y (B, L + padding + right - (K - 1) dilation, Cout)
        contiguous."""
        right = padding if right is None else right
        b, n, _ = x.shape
        out_len = n + padding + right - (conv.taps - 1) * conv.dilation
        # The C code trusts the shapes (a wrong one reads out of bounds rather than raising).
        if not self.supports(x, conv) or padding < 0 or right < 0 or out_len < 1:
            raise ValueError(f"time-major convolution kernel: x {tuple(x.shape)} {x.dtype} "
                             f"(stride {x.stride()}), weight {tuple(conv.weight.shape)}, "
                             f"dilation {conv.dilation}, padding {padding} / {right}")
        y = torch.empty((b, out_len, conv.out_channels), dtype=torch.float32)
        if not y.numel():
            return y
        bias = None if conv.bias is None else conv.bias.data_ptr()
        if self._fn(x.data_ptr(), y.data_ptr(), b, n, conv.in_channels, x.stride(0), x.stride(1),
                    conv.weight.data_ptr(), bias, conv.out_channels, conv.weight.shape[2],
                    conv.taps, conv.dilation, padding, right) != 0:
            raise MemoryError("time-major convolution kernel: no memory for its scratch")
        return y

    def transposed(self, x: torch.Tensor, conv: PackedTransposed) -> torch.Tensor:
        """x (B, L, Cin) as `supports` takes it for conv.phases -> the transposed convolution's
        (B, (L - 1) s + k - 2 cut, Cout) (a view of the phase convolution's output; at least
        one step: a ValueError otherwise)."""
        left, right, first, steps = conv.plan(x.shape[1])
        if steps < 1:
            raise ValueError(f"time-major transposed convolution: {x.shape[1]} input steps give no "
                             f"output (kernel {conv.kernel}, stride {conv.stride}, cut {conv.cut})")
        y = self(x, conv.phases, left, right)                   # (B, blocks, s * Cout)
        return y.view(y.shape[0], -1, conv.out_channels)[:, first:first + steps]

    def depthwise(self, x: torch.Tensor, conv: PackedDepthwise, left: int, right: int = 0) -> torch.Tensor:
        """x (B, L, C) float32 on the CPU with unit-stride channels, `left` zero steps before
        it and `right` after -> y (B, L + left + right - (K - 1) dilation, C) contiguous."""
        b, n, c = x.shape
        out_len = n + left + right - (conv.taps - 1) * conv.dilation
        if (x.device.type != "cpu" or x.dtype != torch.float32 or x.stride(2) != 1
                or c != conv.weight.shape[1] or left < 0 or right < 0 or out_len < 1):
            raise ValueError(f"time-major depthwise convolution kernel: x {tuple(x.shape)} {x.dtype} "
                             f"(stride {x.stride()}), weight {tuple(conv.weight.shape)}, dilation "
                             f"{conv.dilation}, padding {left} / {right}")
        y = torch.empty((b, out_len, c), dtype=torch.float32)
        if y.numel():
            bias = None if conv.bias is None else conv.bias.data_ptr()
            self._depthwise(x.data_ptr(), y.data_ptr(), b, n, c, x.stride(0), x.stride(1),
                            conv.weight.data_ptr(), bias, conv.taps, conv.dilation, left, right)
        return y

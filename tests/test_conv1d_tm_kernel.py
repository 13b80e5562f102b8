"""The time-major 1-D convolution as one native pass (kernels/conv1d_tm.c) against oneDNN's
(layers/time_major.conv1d), its depthwise form and trimmed transposed convolutions as its
phases against PyTorch's, and BigVGAN's AMP blocks on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels.conv1d_tm import PackedConv, PackedDepthwise, TimeMajorConvKernel
from omnistage.layers import time_major
from omnistage.models.qwen2_5_omni.bigvgan import AMPBlock, use_native_activations


@pytest.fixture(scope="module")
def kernel():
    return TimeMajorConvKernel()


def conv(cin: int, cout: int, taps: int, dilation: int, seed: int, bias: bool = True) -> nn.Conv1d:
    torch.manual_seed(seed)
    return nn.Conv1d(cin, cout, taps, dilation=dilation, padding=(taps - 1) * dilation // 2, bias=bias)


# channels below, at and past one 16-lane vector and 32-column tile; lengths shorter than the
# reach, one register tile short, a task (96 steps with AVX-512, 48 without) and more
@pytest.mark.parametrize("cin,cout,taps,dilation,length", [
    (3, 3, 3, 1, 1), (3, 1, 7, 1, 50), (6, 6, 11, 5, 95), (12, 12, 7, 3, 97), (16, 16, 3, 1, 96),
    (24, 24, 11, 5, 300), (48, 48, 7, 3, 700), (80, 96, 7, 1, 61), (96, 96, 3, 1, 1000)])
def test_native_equals_onednn(kernel, cin, cout, taps, dilation, length):
    c = conv(cin, cout, taps, dilation, seed=cin + length)
    x = torch.randn(3, length, cin, generator=torch.Generator().manual_seed(length)) * 2
    with torch.no_grad():
        want = time_major.conv1d(c, x)
        got = kernel(x, PackedConv.of(c), c.padding[0])
    assert got.is_contiguous() and got.shape == want.shape
    # float32 sums of K * Cin products in another order than oneDNN's
    torch.testing.assert_close(got, want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("padding", [0, 1, 17])
def test_other_paddings_and_no_bias(kernel, padding):
    """conv_part pads by what the window lacks, not the module's own padding."""
    c = conv(24, 12, 7, 3, seed=padding, bias=False)
    x = torch.randn(2, 120, 24, generator=torch.Generator().manual_seed(padding))
    with torch.no_grad():
        want = time_major.conv1d(c, x, padding=padding)
        got = kernel(x, PackedConv.of(c), padding)
    torch.testing.assert_close(got, want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("channels,taps,dilation", [(3, 11, 5), (24, 7, 3), (48, 3, 1), (96, 11, 1)])
def test_avx2_width_build_gives_the_same_bits(kernel, channels, taps, dilation):
    """The 6 x 16 tiles (CPUs without AVX-512) and the 12 x 32 ones add the same products in
    the same order: the same bits."""
    c = conv(channels, channels, taps, dilation, seed=channels)
    x = torch.randn(2, 333, channels, generator=torch.Generator().manual_seed(channels))
    packed = PackedConv.of(c)
    assert torch.equal(TimeMajorConvKernel(wide_vectors=False)(x, packed, c.padding[0]),
                       kernel(x, packed, c.padding[0]))


def test_strided_view_and_rows_alone(kernel):
    """A sliced view (batch stride longer than L * C) is read in place, and a row's output is
    the same bits alone as in a batch, and in a window that starts later (past the reach)."""
    c = conv(32, 32, 7, 3, seed=5)
    packed = PackedConv.of(c)
    full = torch.randn(4, 530, 32, generator=torch.Generator().manual_seed(1))
    x = full[:, 9:-21]
    with torch.no_grad():
        want = time_major.conv1d(c, x)
    got = kernel(x, packed, 9)
    torch.testing.assert_close(got, want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)
    for b in range(4):
        assert torch.equal(kernel(x[b:b + 1], packed, 9), got[b:b + 1])
    assert torch.equal(kernel(x[1:2, 100:], packed, 9)[:, 9:], got[1:2, 109:])


def test_refuses_what_it_cannot_take(kernel):
    c = conv(8, 8, 3, 1, seed=0)
    packed = PackedConv.of(c)
    with pytest.raises(ValueError, match="time-major convolution kernel"):
        kernel(torch.randn(1, 10, 9), packed, 1)                       # channels
    with pytest.raises(ValueError, match="time-major convolution kernel"):
        kernel(torch.randn(1, 10, 8, dtype=torch.float64), packed, 1)  # dtype
    with pytest.raises(ValueError, match="stride 1, one group"):
        PackedConv.of(nn.Conv1d(8, 8, 3, stride=2))
    assert not kernel.supports(torch.randn(1, 8, 10).transpose(1, 2), packed)   # channels strided
    # weights past MAX_WEIGHT_BYTES (384 x 384 x 11: 6.3 MB) are oneDNN's to run, not packed
    assert TimeMajorConvKernel.serves(nn.Conv1d(96, 96, 11)) and TimeMajorConvKernel.serves(nn.Conv1d(3, 1, 7))
    assert not TimeMajorConvKernel.serves(nn.Conv1d(384, 384, 11))
    assert not TimeMajorConvKernel.serves(nn.Conv1d(8, 8, 3, stride=2))
    wide = AMPBlock(384, 11, [1], torch.device("cpu"))
    wide.kernel = kernel
    assert wide.packed() == [None, None]


def test_amp_block_on_the_kernel_equals_onednn_and_repacks_after_a_load():
    torch.manual_seed(3)
    block = AMPBlock(24, 7, [1, 3, 5], torch.device("cpu"))
    use_native_activations(block)
    x = torch.randn(2, 400, 24)
    with torch.no_grad():
        want = block(x)
        block.kernel = TimeMajorConvKernel()
        got = block(x)
        torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
        block.convs1[1].weight.mul_(0.5)                                 # a load after packing
        block.kernel = None
        want = block(x)
        block.kernel = TimeMajorConvKernel()
        torch.testing.assert_close(block(x), want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("left,right", [(6, 0), (0, 0), (2, 5)])
def test_uneven_padding(kernel, left, right):
    """A causal convolution pads the front only: the same as padding both ends by the front's
    and cutting the back's surplus (or padding the back alone)."""
    c = conv(24, 20, 7, 1, seed=left, bias=True)
    x = torch.randn(2, 50, 24, generator=torch.Generator().manual_seed(right))
    with torch.no_grad():
        both = time_major.conv1d(c, x, padding=max(left, right))
    got = kernel(x, PackedConv.of(c), left, right)
    assert got.shape == (2, 50 + left + right - 6, 20)
    skip = max(left, right) - left
    torch.testing.assert_close(got, both[:, skip:skip + got.shape[1]], atol=2e-6 * both.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("channels,taps,dilation,length,left,right", [
    (256, 7, 1, 40, 6, 0), (20, 7, 2, 5, 12, 0), (16, 3, 1, 300, 1, 1), (33, 5, 3, 1, 12, 3)])
def test_depthwise_equals_pytorch(kernel, channels, taps, dilation, length, left, right):
    torch.manual_seed(channels)
    c = nn.Conv1d(channels, channels, taps, dilation=dilation, groups=channels)
    x = torch.randn(3, length, channels, generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        want = F.conv1d(F.pad(x.transpose(1, 2), (left, right)), c.weight, c.bias, dilation=dilation,
                        groups=channels).transpose(1, 2)
    got = kernel.depthwise(x, PackedDepthwise.of(c), left, right)
    assert got.is_contiguous() and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)
    # a strided view is read in place; a row alone gives the same bits as in the batch
    assert torch.equal(kernel.depthwise(x[1:2], PackedDepthwise.of(c), left, right), got[1:2])
    with pytest.raises(ValueError, match="one group per channel"):
        PackedDepthwise.of(nn.Conv1d(channels, channels, taps))


# kernel = stride (nothing trimmed) and 2 x stride (stride trimmed from each end); columns
# s * Cout below, at and past a 16-column block
@pytest.mark.parametrize("cin,cout,stride,twice,length", [
    (16, 8, 3, True, 50), (32, 16, 8, True, 7), (8, 4, 5, True, 2), (12, 6, 2, False, 9), (64, 32, 4, True, 100)])
def test_transposed_as_phases_equals_pytorch(kernel, cin, cout, stride, twice, length):
    torch.manual_seed(cin + stride)
    k = 2 * stride if twice else stride
    c = nn.ConvTranspose1d(cin, cout, k, stride=stride)
    x = torch.randn(2, length, cin, generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        want = F.conv_transpose1d(x.transpose(1, 2), c.weight, c.bias, stride=stride,
                                  padding=k - stride).transpose(1, 2)
    packed = PackedConv.of_transposed(c)
    assert TimeMajorConvKernel.serves_transposed(c) and packed.taps == k // stride
    y = kernel(x, packed, 0)
    got = y.view(2, y.shape[1] * stride, cout)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)
    with pytest.raises(ValueError, match="kernel = stride or 2 x stride"):
        PackedConv.of_transposed(nn.ConvTranspose1d(cin, cout, 3, stride=2))
    assert not TimeMajorConvKernel.serves_transposed(nn.ConvTranspose1d(512, 512, 16, stride=8))

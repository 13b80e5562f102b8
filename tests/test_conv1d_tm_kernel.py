"""The time-major 1-D convolution as one native pass (kernels/conv1d_tm.c) against PyTorch's
(oneDNN's), its depthwise form and transposed convolutions as its phases against PyTorch's,
and BigVGAN's AMP blocks on it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels.conv1d_tm import PackedConv, PackedDepthwise, PackedTransposed, TimeMajorConvKernel
from omnistage.models.qwen2_5_omni.bigvgan import AMPBlock, use_native_activations


@pytest.fixture(scope="module")
def kernel():
    return TimeMajorConvKernel()


def reference(c: nn.Conv1d, x: torch.Tensor, padding: int | None = None) -> torch.Tensor:
    """PyTorch's convolution of time-major x (B, L, Cin), `padding` both ends (default the
    module's) -> (B, L', Cout)."""
    pad = c.padding[0] if padding is None else padding
    return F.conv1d(x.transpose(1, 2), c.weight, c.bias, padding=pad, dilation=c.dilation[0]).transpose(1, 2)


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
        want = reference(c, x)
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
        want = reference(c, x, padding)
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
        want = reference(c, x)
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
    assert [run.packed() for run in wide.runs] == [None, None]


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
        both = reference(c, x, max(left, right))
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


# code2wav's forms (kernel = stride, nothing cut; 2 x stride, stride cut from each end) and
# BigVGAN's upsamplers (kernel 11 / 7 / 4, stride 5 / 3 / 2, (k - s) / 2 cut), and cuts of
# whole blocks and more; columns s * Cout below, at and past a 16-column block; one step in
@pytest.mark.parametrize("cin,cout,stride,k,cut,length", [
    (16, 8, 3, 6, 3, 50), (32, 16, 8, 16, 8, 7), (8, 4, 5, 10, 5, 2), (12, 6, 2, 2, 0, 9), (64, 32, 4, 8, 4, 100),
    (24, 12, 5, 11, 3, 40), (12, 6, 3, 7, 2, 1), (6, 3, 2, 4, 1, 33), (8, 8, 2, 4, 0, 5), (8, 5, 3, 7, 6, 4)])
def test_transposed_as_phases_equals_pytorch(kernel, cin, cout, stride, k, cut, length):
    torch.manual_seed(cin + stride)
    c = nn.ConvTranspose1d(cin, cout, k, stride=stride, padding=cut)
    x = torch.randn(2, length, cin, generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        want = F.conv_transpose1d(x.transpose(1, 2), c.weight, c.bias, stride=stride, padding=cut).transpose(1, 2)
    packed = PackedTransposed.of(c)
    assert TimeMajorConvKernel.serves_transposed(c) and packed.phases.taps == -(-k // stride)
    got = kernel.transposed(x, packed)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)
    # the cut can be given apart from the module's own padding (code2wav cuts by hand)
    uncut = nn.ConvTranspose1d(cin, cout, k, stride=stride)
    uncut.load_state_dict(c.state_dict())
    torch.testing.assert_close(kernel.transposed(x, PackedTransposed.of(uncut, cut)), got, atol=0, rtol=0)


def test_transposed_forms_it_does_not_take(kernel):
    for bad in (nn.ConvTranspose1d(8, 8, 4, stride=2, padding=4), nn.ConvTranspose1d(8, 8, 4, stride=2, groups=2),
                nn.ConvTranspose1d(8, 8, 4, stride=2, padding=1, output_padding=1),
                nn.ConvTranspose1d(8, 8, 4, stride=2, dilation=2)):
        assert not TimeMajorConvKernel.serves_transposed(bad)
        with pytest.raises(ValueError, match="0 <= padding < kernel"):
            PackedTransposed.of(bad)
    assert not TimeMajorConvKernel.serves_transposed(nn.ConvTranspose1d(512, 512, 16, stride=8))
    # one input step of a kernel cutting a whole stride from each end gives no output
    with pytest.raises(ValueError, match="give no output"):
        kernel.transposed(torch.randn(1, 1, 8), PackedTransposed.of(nn.ConvTranspose1d(8, 4, 4, stride=2), 2))

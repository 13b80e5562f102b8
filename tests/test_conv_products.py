"""Time-major convolutions as matrix products (layers/conv_products.py) against PyTorch's own
convolutions in the usual (B, C, L) layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from omnistage.layers.conv_products import TapMatrix, causal_conv1d, conv1d, conv_transpose1d


def randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def causal_reference(conv: nn.Conv1d, x: torch.Tensor) -> torch.Tensor:
    """x (B, L, C) -> (B, L, Cout): the conv over x left-padded by its reach, by F.conv1d."""
    reach = (conv.kernel_size[0] - 1) * conv.dilation[0]
    y = F.conv1d(F.pad(x.transpose(1, 2), (reach, 0)), conv.weight, conv.bias,
                 dilation=conv.dilation, groups=conv.groups)
    return y.transpose(1, 2)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    if not want.numel():
        return
    # float32 sums of taps x Cin products in another order than PyTorch's
    torch.testing.assert_close(got, want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)


# lengths shorter than, equal to and past the reach; one output channel (a vocoder's last conv)
@pytest.mark.parametrize("cin,cout,taps,dilation,length,bias", [
    (3, 5, 7, 1, 1, True), (16, 1, 7, 1, 50, True), (8, 8, 7, 3, 18, False), (8, 8, 7, 9, 19, True),
    (32, 48, 7, 1, 300, True), (24, 24, 1, 1, 40, True)])
def test_causal_equals_pytorch(cin, cout, taps, dilation, length, bias):
    torch.manual_seed(cin + length)
    conv = nn.Conv1d(cin, cout, taps, dilation=dilation, bias=bias)
    x = randn(3, length, cin, seed=length)
    with torch.no_grad():
        close(causal_conv1d(conv, x, TapMatrix()), causal_reference(conv, x))


@pytest.mark.parametrize("channels,dilation,length,bias", [(16, 1, 3, True), (64, 1, 40, True), (32, 2, 25, False)])
def test_depthwise_equals_pytorch(channels, dilation, length, bias):
    torch.manual_seed(channels)
    conv = nn.Conv1d(channels, channels, 7, dilation=dilation, groups=channels, bias=bias)
    x = randn(2, length, channels, seed=length)
    with torch.no_grad():
        close(causal_conv1d(conv, x, TapMatrix()), causal_reference(conv, x))


# symmetric and uneven padding (BigVGAN's windows pad by what they lack), one output step
@pytest.mark.parametrize("cin,cout,taps,dilation,length,left,right,groups", [
    (8, 6, 7, 1, 30, 3, 3, 1), (8, 8, 11, 5, 60, 25, 4, 1), (12, 12, 7, 3, 9, 0, 10, 1), (5, 1, 7, 1, 1, 3, 3, 1),
    (16, 16, 7, 3, 40, 9, 2, 16)])
def test_padded_equals_pytorch(cin, cout, taps, dilation, length, left, right, groups):
    torch.manual_seed(cin + left)
    conv = nn.Conv1d(cin, cout, taps, dilation=dilation, groups=groups)
    x = randn(2, length, cin, seed=length)
    with torch.no_grad():
        want = F.conv1d(F.pad(x.transpose(1, 2), (left, right)), conv.weight, conv.bias,
                        dilation=conv.dilation, groups=groups).transpose(1, 2)
        close(conv1d(conv, x, TapMatrix(), left, right), want)


# code2wav's forms (kernel = stride, nothing cut; 2 x stride, stride cut from each end, given
# apart from the module's padding) and BigVGAN's upsamplers (module padding (k - s) / 2); one
# step in, and one that gives no output
@pytest.mark.parametrize("cin,cout,stride,kernel,cut,own,length,bias", [
    (32, 32, 2, 2, 0, False, 10, True), (16, 8, 5, 5, 0, False, 1, False), (32, 16, 8, 16, 8, False, 12, True),
    (8, 4, 3, 6, 3, False, 1, True), (12, 6, 4, 8, 4, False, 2, False), (16, 8, 5, 10, 5, False, 100, True),
    (24, 12, 5, 11, 3, True, 40, True), (12, 6, 3, 7, 2, True, 1, True), (6, 3, 2, 4, 1, True, 33, False),
    (8, 5, 3, 7, 6, True, 4, True)])
def test_transposed_equals_pytorch(cin, cout, stride, kernel, cut, own, length, bias):
    torch.manual_seed(cin + stride)
    conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride, padding=cut if own else 0, bias=bias)
    x = randn(3, length, cin, seed=length)
    with torch.no_grad():
        want = F.conv_transpose1d(x.transpose(1, 2), conv.weight, conv.bias, stride=stride,
                                  padding=cut).transpose(1, 2)
        got = conv_transpose1d(conv, x, TapMatrix(), None if own else cut)
    assert got.shape == (3, (length - 1) * stride + kernel - 2 * cut, cout)
    close(got, want)


def test_tap_matrix_follows_a_load_and_a_move():
    """The derived matrix is made again after the weight is loaded in place or replaced, not
    kept stale."""
    torch.manual_seed(0)
    conv, taps = nn.Conv1d(8, 8, 3), TapMatrix()
    x = randn(1, 10, 8, seed=1)
    with torch.no_grad():
        before = causal_conv1d(conv, x, taps)
        assert taps(conv) is taps(conv)                      # derived once while unchanged
        conv.weight.copy_(randn(8, 8, 3, seed=2))            # a checkpoint load
        close(causal_conv1d(conv, x, taps), causal_reference(conv, x))
        conv.to(torch.float64)
        assert taps(conv).dtype == torch.float64
    assert not torch.equal(before, causal_conv1d(conv, x.double(), taps).float())


def test_what_it_does_not_take_is_refused():
    x = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="stride 1"):
        causal_conv1d(nn.Conv1d(8, 8, 3, stride=2), x, TapMatrix())
    with pytest.raises(ValueError, match="one group or depthwise"):
        causal_conv1d(nn.Conv1d(8, 8, 3, groups=2), x, TapMatrix())
    with pytest.raises(ValueError, match="0 <= padding < kernel"):
        conv_transpose1d(nn.ConvTranspose1d(8, 8, 3, stride=2, groups=2), x, TapMatrix())
    with pytest.raises(ValueError, match="0 <= padding < kernel"):
        conv_transpose1d(nn.ConvTranspose1d(8, 8, 3, stride=2), x, TapMatrix(), padding=3)
    with pytest.raises(ValueError, match="at least one step"):
        conv1d(nn.Conv1d(8, 8, 7), x, TapMatrix(), 0, 0)

"""Time-major convolutions as matrix products (layers/conv_products.py) against PyTorch's own
convolutions in the usual (B, C, L) layout."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from omnistage.kernels.conv1d_tm import is_trimmed_transposed
from omnistage.layers.conv_products import TapMatrix, causal_conv1d, trimmed_conv_transpose1d


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


# kernel = stride (nothing cut) and kernel = 2 x stride (stride cut from each end); one step in
@pytest.mark.parametrize("cin,cout,stride,twice,length,bias", [
    (32, 32, 2, False, 10, True), (16, 8, 5, False, 1, False), (32, 16, 8, True, 12, True),
    (8, 4, 3, True, 1, True), (12, 6, 4, True, 2, False), (16, 8, 5, True, 100, True)])
def test_trimmed_transposed_equals_pytorch(cin, cout, stride, twice, length, bias):
    torch.manual_seed(cin + stride)
    kernel = 2 * stride if twice else stride
    conv = nn.ConvTranspose1d(cin, cout, kernel, stride=stride, bias=bias)
    x = randn(3, length, cin, seed=length)
    with torch.no_grad():
        want = F.conv_transpose1d(x.transpose(1, 2), conv.weight, conv.bias, stride=stride,
                                  padding=kernel - stride).transpose(1, 2)
        got = trimmed_conv_transpose1d(conv, x, TapMatrix())
    assert got.shape == (3, length * stride - (kernel - stride), cout)
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
    odd = nn.ConvTranspose1d(8, 8, 3, stride=2)
    assert not is_trimmed_transposed(odd)
    with pytest.raises(ValueError, match="kernel = stride or 2 x stride"):
        trimmed_conv_transpose1d(odd, x, TapMatrix())

"""Qwen3-Omni code2wav's residual unit as one native pass (kernels/code2wav_unit.c) against
the torch ops it replaces."""

from __future__ import annotations

import pytest
import torch

from omnistage.kernels.code2wav_unit import Code2WavUnitKernel
from omnistage.models.qwen3_omni.code2wav import ResidualUnit, use_native_units


def unit(channels: int, dilation: int, seed: int) -> ResidualUnit:
    g = torch.Generator().manual_seed(seed)
    m = ResidualUnit(channels, dilation)
    for p in m.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


@pytest.fixture(scope="module")
def kernel():
    return Code2WavUnitKernel()


def native_and_torch(m: ResidualUnit, kernel, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m.kernel = None
    want = m(x)
    m.kernel = kernel
    return m(x), want


# lengths: shorter than the causal reach, one register tile short, a task (240 steps) and a
# partial one, several tasks
@pytest.mark.parametrize("channels,dilation,length", [(16, 1, 1), (16, 9, 50), (32, 3, 239), (32, 1, 240),
                                                      (48, 9, 241), (64, 3, 700), (128, 1, 61)])
def test_native_equals_torch(kernel, channels, dilation, length):
    m = unit(channels, dilation, seed=channels + length)
    x = torch.randn(3, length, channels, generator=torch.Generator().manual_seed(length)) * 2
    got, want = native_and_torch(m, kernel, x)
    assert got.is_contiguous() and got.shape == want.shape
    # float32 sums of 7 * C products in another order than oneDNN's
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, atol=2e-6 * scale, rtol=1e-5)


@pytest.mark.parametrize("channels,dilation,length", [(16, 9, 50), (32, 3, 241), (48, 1, 700), (128, 3, 61)])
def test_avx2_width_build_gives_the_same_bits(kernel, channels, dilation, length):
    """The 8-lane tiles (CPUs without AVX-512) and the 16-lane ones (where this CPU has it)
    add the same products in the same order: the same bits, for 16-channel remainders too."""
    m = unit(channels, dilation, seed=channels + dilation)
    x = torch.randn(2, length, channels, generator=torch.Generator().manual_seed(length)) * 2
    m.kernel = kernel
    wide = m(x)
    m.kernel = Code2WavUnitKernel(wide_vectors=False)
    assert torch.equal(m(x), wide)


def test_strided_view_and_rows_alone(kernel):
    """A sliced time-major view (batch stride longer than L * C) reads each step where it is,
    and a row's output is the same bits alone as in a batch (every step's arithmetic is the
    same wherever its tile falls)."""
    m = unit(32, 3, seed=7)
    full = torch.randn(4, 530, 32, generator=torch.Generator().manual_seed(1))
    x = full[:, 9:-21]
    got, want = native_and_torch(m, kernel, x)
    torch.testing.assert_close(got, want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)
    for b in range(4):
        assert torch.equal(m(x[b:b + 1]), got[b:b + 1])
    # a later window of the same row: the steps past the causal reach (6 * 3) are the same bits
    assert torch.equal(m(x[1:2, 100:])[:, 18:], got[1:2, 118:])


def test_out_of_range_values_through_libm(kernel):
    m = unit(16, 1, seed=3)
    x = torch.randn(2, 300, 16, generator=torch.Generator().manual_seed(2))
    x[1, 250, 4] = 1e6                       # past the polynomial's reduction range
    got, want = native_and_torch(m, kernel, x)
    torch.testing.assert_close(got, want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)


def test_other_inputs_keep_the_torch_path(kernel):
    m = unit(8, 1, seed=4)                   # channels not a multiple of 16
    x = torch.randn(1, 20, 8)
    got, want = native_and_torch(m, kernel, x)
    assert not kernel.supports(x, 8) and torch.equal(got, want)
    m64 = unit(16, 1, seed=5).double()
    x64 = torch.randn(1, 20, 16, dtype=torch.float64)
    got, want = native_and_torch(m64, kernel, x64)
    assert torch.equal(got, want)
    m32 = unit(16, 1, seed=5)
    m32.kernel = kernel
    assert m32(torch.zeros(2, 0, 16)).shape == (2, 0, 16)


def test_new_weights_are_packed_again(kernel):
    """Weights loaded after the kernel was set (a reload) are the ones used."""
    m = unit(16, 3, seed=6)
    x = torch.randn(2, 100, 16)
    m.kernel = kernel
    before = m(x)
    with torch.no_grad():
        m.conv1.conv.weight.mul_(0.5)
        m.act2.alpha.add_(0.1)
    got, want = native_and_torch(m, kernel, x)
    assert not torch.allclose(got, before)
    torch.testing.assert_close(got, want, atol=2e-6 * want.abs().max().item(), rtol=1e-5)


def test_use_native_units_sets_every_unit():
    model = torch.nn.Sequential(unit(16, 1, 0), torch.nn.Sequential(unit(32, 3, 1)))
    assert use_native_units(model) == 2
    assert all(isinstance(m.kernel, Code2WavUnitKernel) for m in model.modules() if isinstance(m, ResidualUnit))
    assert use_native_units(torch.nn.Linear(2, 2)) == 0

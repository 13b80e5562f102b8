"""BigVGAN's anti-aliased SnakeBeta as one native pass (kernels/aa_snake.c) against transformers'
Qwen2.5-Omni activation (upsample, SnakeBeta, downsample: the oracle) and our torch path."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
    Qwen2_5OmniAntiAliasedActivation1d, Qwen2_5OmniSnakeBeta)

from omnistage.kernels.aa_snake import AntiAliasedSnakeKernel
from omnistage.models.qwen2_5_omni.bigvgan import AntiAliasedSnake, use_native_activations


@pytest.fixture(scope="module")
def kernel():
    return AntiAliasedSnakeKernel()


def reference(channels: int, taps: int, seed: int) -> Qwen2_5OmniAntiAliasedActivation1d:
    g = torch.Generator().manual_seed(seed)
    snake = Qwen2_5OmniSnakeBeta(channels)
    with torch.no_grad():
        snake.alpha.copy_(torch.randn(channels, generator=g) * 0.5)
        snake.beta.copy_(torch.randn(channels, generator=g) * 0.5)
    return Qwen2_5OmniAntiAliasedActivation1d(snake, up_kernel_size=taps, down_kernel_size=taps).eval()


def run_kernel(kernel, ref: Qwen2_5OmniAntiAliasedActivation1d, x_time_major: torch.Tensor) -> torch.Tensor:
    snake = ref.act
    freq = snake.alpha.detach().exp()
    inv_mag = 1.0 / (snake.beta.detach().exp() + 1e-9)
    # ratio 2: the up- and down-sampling filters are the same low-pass
    assert torch.equal(ref.upsample.filter, ref.downsample.filter)
    return kernel(x_time_major, ref.upsample.filter.view(-1), freq, inv_mag)


@pytest.mark.parametrize("channels", [1, 3, 16, 20, 48])
@pytest.mark.parametrize("length", [1, 2, 7, 300])
def test_equals_transformers(kernel, channels, length):
    """Every channel count (C = 3: lanes run along the flat (step, channel) index) and lengths
    shorter than the filter (both ends replicate-padded inside one tile); atol 1e-5 for
    activations of magnitude ~5 (float32 sums in another order; measured ~1e-6)."""
    ref = reference(channels, 12, seed=channels + length)
    x = torch.randn(2, channels, length, generator=torch.Generator().manual_seed(length)) * 2
    with torch.no_grad():
        want = ref(x)
    got = run_kernel(kernel, ref, x.transpose(1, 2))
    assert got.shape == (2, length, channels) and got.is_contiguous()
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("taps", [4, 8, 16])
def test_other_filter_lengths_equal_transformers(kernel, taps):
    ref = reference(5, taps, seed=taps)
    x = torch.randn(1, 5, 123, generator=torch.Generator().manual_seed(taps))
    with torch.no_grad():
        want = ref(x)
    torch.testing.assert_close(run_kernel(kernel, ref, x.transpose(1, 2)).transpose(1, 2), want,
                               atol=1e-5, rtol=1e-5)


def test_many_tiles_and_strided_input(kernel):
    """Lengths spanning many tasks (tile edges inside the signal), a batch whose rows are views
    with a step stride other than C, and sin arguments beyond the polynomial's range (those lanes
    go through libm)."""
    ref = reference(24, 12, seed=3)
    base = torch.randn(3, 5000, 30, generator=torch.Generator().manual_seed(4))
    x = base[:, 100:4100, 2:26]                          # (3, 4000, 24), steps 30 floats apart
    x[1, 50:53, 0] = torch.tensor([2e4, -3e5, 9e3])
    assert x.stride(1) == 30
    with torch.no_grad():
        want = ref(x.transpose(1, 2).contiguous())
    got = run_kernel(kernel, ref, x)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-3, rtol=1e-5)   # values ~3e5
    torch.testing.assert_close(got[0], want[0].T, atol=1e-5, rtol=1e-5)


def test_module_takes_the_kernel_and_others_keep_torch(kernel):
    torch.manual_seed(0)
    m = AntiAliasedSnake(6, torch.device("cpu"))
    m.act.alpha.normal_(0, 0.5)
    m.act.beta.normal_(0, 0.5)
    x = torch.randn(2, 90, 6)
    want = m(x)
    x64 = x.double()
    want64 = copy.deepcopy(m).double()(x64)
    assert use_native_activations(torch.nn.Sequential(m)) == 1 and m.kernel is not None
    got = m(x)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)
    assert (got - want).abs().max() > 0                  # really the other code path
    assert not m.kernel.supports(x64, 12)
    assert torch.equal(m.double()(x64), want64)          # float64: the torch ops, bit for bit
    assert kernel(torch.zeros(0, 5, 3), m.fir.float(), torch.ones(3), torch.ones(3)).shape == (0, 5, 3)


def test_kernel_follows_parameters_changed_after_use(kernel):
    """The kernel's (freq, inv_mag) are kept between calls (SnakeBeta.parameters_for_kernel):
    a load that changes alpha or beta in place, or replaces them, is seen by the next call."""
    torch.manual_seed(1)
    m = AntiAliasedSnake(4, torch.device("cpu"))
    use_native_activations(torch.nn.Sequential(m))
    x = torch.randn(1, 64, 4)
    before = m(x)
    with torch.no_grad():
        m.act.alpha.copy_(torch.randn(4))                  # in place, as load_weights does
    after = m(x)
    assert not torch.equal(after, before)
    m.kernel = None
    torch.testing.assert_close(after, m(x), atol=2e-6, rtol=1e-6)   # the torch path's values
    for change in ("replaced", "data"):
        m.kernel = kernel
        if change == "replaced":
            m.act.beta = torch.nn.Parameter(torch.randn(4), requires_grad=False)
        else:                                              # as module.to() converts
            m.act.beta.data = torch.randn(4)
        got = m(x)
        m.kernel = None
        torch.testing.assert_close(got, m(x), atol=2e-6, rtol=1e-6)
    m.kernel = kernel
    assert m.act.parameters_for_kernel()[0] is m.act.parameters_for_kernel()[0]   # kept while unchanged


def test_bad_shapes_raise_instead_of_reading_out_of_bounds(kernel):
    x = torch.randn(1, 10, 4)
    fir = torch.ones(12) / 12
    with pytest.raises(ValueError):
        kernel(x, fir, torch.ones(3), torch.ones(4))
    with pytest.raises(ValueError):
        kernel(x, torch.ones(11) / 11, torch.ones(4), torch.ones(4))       # odd taps

"""SnakeBeta's native one-pass kernel (kernels/snake.c) against the torch ops it replaces."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from omnistage.kernels.snake import SnakeKernel
from omnistage.layers.snake import SnakeBeta, TimeMajorSnakeBeta, use_native_snake


def snake(channels: int, seed: int) -> SnakeBeta:
    g = torch.Generator().manual_seed(seed)
    m = SnakeBeta(channels)
    m.alpha.copy_(torch.randn(channels, generator=g) * 0.7)
    m.beta.copy_(torch.randn(channels, generator=g) * 0.7)
    return m


@pytest.fixture(scope="module")
def kernel():
    return SnakeKernel()


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 3, 17), (1, 16, 7680), (3, 5, 100), (4, 64, 33)])
def test_native_equals_torch(kernel, shape):
    torch.manual_seed(sum(shape))
    x = torch.randn(shape) * 4                       # sin's argument over many periods
    m = snake(shape[1], seed=shape[-1])
    want = m(x)
    m.kernel = kernel
    got = m(x)
    assert got.is_contiguous() and got.shape == want.shape
    # float32 rounding of a sum whose terms reach ~10: within 2 ulp of the torch ops
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)
    assert (got - want).abs().max() > 0 or x.numel() < 16     # really another code path


def test_strided_inputs_and_extreme_values(kernel):
    m = snake(4, seed=1)
    x = torch.randn(2, 4, 40)[..., 3:-5]             # a trimmed transposed conv's output view
    x[0, 0, :6] = torch.tensor([3e4, -1e6, float("inf"), float("-inf"), float("nan"), 8191.0])
    want = m(x)
    m.kernel = kernel
    got = m(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6, equal_nan=True)
    assert got[0, 0, 2:5].isnan().all()              # inf + nan, as torch gives


def test_other_inputs_keep_the_torch_path(kernel):
    m = snake(3, seed=2).double()
    x = torch.randn(1, 3, 20, dtype=torch.float64)
    want = m(x)
    m.kernel = kernel
    assert not kernel.supports(x)
    assert torch.equal(m(x), want)                   # float64: the same ops, bit for bit
    m32 = snake(3, seed=2)
    m32.kernel = kernel
    assert m32(torch.zeros(0, 3, 5)).shape == (0, 3, 5)      # empty: nothing for the C code


def test_use_native_snake_sets_every_activation():
    model = nn.Sequential(snake(2, 0), nn.Conv1d(2, 2, 1), nn.Sequential(snake(2, 1)))
    assert use_native_snake(model) == 2
    assert all(isinstance(m.kernel, SnakeKernel) for m in model.modules() if isinstance(m, SnakeBeta))
    assert use_native_snake(nn.Linear(2, 2)) == 0


@pytest.mark.parametrize("shape", [(1, 1, 1), (2, 17, 3), (1, 7680, 16), (3, 100, 40), (2, 33, 64)])
def test_time_major_native_equals_torch(kernel, shape):
    """The time-major form (B, L, C), channels unit-stride: whole vectors of channels and a
    tail of C % 16, each lane with its own channel's parameters."""
    torch.manual_seed(sum(shape))
    x = torch.randn(shape) * 4
    m = TimeMajorSnakeBeta(shape[2])
    m.load_state_dict(snake(shape[2], seed=shape[1]).state_dict())
    want = m(x)
    torch.testing.assert_close(want, snake(shape[2], seed=shape[1])(x.transpose(1, 2)).transpose(1, 2))
    m.kernel = kernel
    got = m(x)
    assert got.is_contiguous() and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6)
    assert (got - want).abs().max() > 0 or x.numel() < 16


def test_time_major_strided_steps(kernel):
    """A trimmed or sliced time-major view (batch stride longer than L * C) reads each step
    where it is."""
    m = snake(20, seed=3)
    tm = TimeMajorSnakeBeta(20)
    tm.load_state_dict(m.state_dict())
    x = torch.randn(3, 50, 20)[:, 4:-6]
    x[1, 2, :3] = torch.tensor([3e4, float("inf"), float("nan")])
    want = tm(x)
    tm.kernel = kernel
    got = tm(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6, equal_nan=True)
    assert got[1, 2, 1:3].isnan().all()


@pytest.mark.parametrize("time_major", [False, True])
def test_a_lane_out_of_range_redoes_only_its_task(kernel, time_major):
    """The kernel checks the polynomial's range once per task (512 steps of a row) and redoes a
    task that had a lane out of it through libm: values out of range in one task of a long row,
    every task's values as torch gives."""
    m = snake(16, seed=4)
    x = torch.randn(2, 16, 1700) * 4
    x[1, 5, 700] = 1e6                               # the second task of row (1, 5) / of batch 1
    x[0, 3, 1650] = float("nan")                     # the last, partial task
    mod = m
    if time_major:
        mod = TimeMajorSnakeBeta(16)
        mod.load_state_dict(m.state_dict())
        x = x.transpose(1, 2).contiguous()
    want = mod(x)
    mod.kernel = kernel
    got = mod(x)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-6, equal_nan=True)
    assert got.isnan().sum() == 1

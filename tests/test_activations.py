"""GELU without oneDNN (layers/activations.py) against F.gelu."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from omnistage.layers.activations import gelu


def test_gelu_equals_pytorch_within_rounding():
    x = torch.randn(3, 37, 128, generator=torch.Generator().manual_seed(0)) * 4
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 30.0, -30.0])
    torch.testing.assert_close(gelu(x), F.gelu(x), atol=1e-6, rtol=1e-6)
    assert gelu(x[:, ::2]).shape == (3, 19, 128)                  # any strides
    half = x.bfloat16()
    assert torch.equal(gelu(half), F.gelu(half))                  # other dtypes: F.gelu itself


def test_gelu_makes_no_onednn_primitive():
    """F.gelu's erf form on float32 CPU tensors is a oneDNN eltwise primitive per shape; this
    one is ATen's elementwise kernels."""
    with torch.autograd.profiler.profile() as prof:
        for length in (5, 6, 7):
            gelu(torch.randn(1, length, 16))
    ops = {e.name for e in prof.function_events}
    assert "aten::erf_" in ops and "aten::gelu" not in ops
